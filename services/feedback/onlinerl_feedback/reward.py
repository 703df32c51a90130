"""Reward of one rated completion: a pure mapping from (accepted, shown text) to a number, set by ``feedback.reward``.

Kept apart from the HTTP layer so the trainer, the simulator and the tests all agree on one definition.
The default ``chars`` preset pays an accept by the characters it shows (0.5 + 0.0125 per character up to 40:
0.55 to 1.0), penalises rejects (-0.25) and gives 0 to an empty suggestion, so the policy can learn that staying
silent beats a bad suggestion without learning that four sure characters beat a whole line. ``cursor`` is Cursor's
flat +0.75 / -0.25 / 0; ``rlinf`` reproduces the seed's 1/0 (onlinerl/config.py says why each).
"""

from __future__ import annotations

from onlinerl.config import RewardConfig


def is_empty_suggestion(shown_text: str) -> bool:
    """A served completion whose shown text is empty or whitespace only: the model effectively said nothing."""
    return not shown_text.strip()


def reward_for(accepted: bool, shown_text: str, cfg: RewardConfig) -> float:
    """The reward the trainer learns from. An empty suggestion earns ``cfg.empty`` whatever ``accepted`` says; an
    accept earns ``cfg.accepted`` plus ``cfg.accepted_per_char`` per shown character (trimmed) up to the cap."""
    if is_empty_suggestion(shown_text):
        return cfg.empty
    if not accepted:
        return cfg.rejected
    return cfg.accepted + cfg.accepted_per_char * min(len(shown_text.strip()), cfg.accepted_chars_cap)
