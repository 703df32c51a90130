"""Reward of one rated completion: a pure mapping from (accepted, empty) to a number, set by ``feedback.reward``.

Kept apart from the HTTP layer so the trainer, the simulator and the tests all agree on one definition.
The ``cursor`` preset rewards accepts (+0.75), penalises rejects (-0.25) and gives 0 to an empty suggestion, so the
policy can learn that staying silent beats a bad suggestion; ``rlinf`` reproduces the seed's 1/0.
"""

from __future__ import annotations

from onlinerl.config import RewardConfig


def is_empty_suggestion(shown_text: str) -> bool:
    """A served completion whose shown text is empty or whitespace only: the model effectively said nothing."""
    return not shown_text.strip()


def reward_for(accepted: bool, shown_text: str, cfg: RewardConfig) -> float:
    """The reward the trainer learns from. An empty suggestion earns ``cfg.empty`` whatever ``accepted`` says."""
    if is_empty_suggestion(shown_text):
        return cfg.empty
    return cfg.accepted if accepted else cfg.rejected
