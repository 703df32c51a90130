"""The simulated Continue user: what it is shown, and whether it presses Tab.

Pure functions, so the rule the demonstration is judged by is explicit and tested. Default rule: accept when the
shown text (trimmed) is non-empty and either a prefix of the true middle of at least ``min_prefix_chars`` characters
(or the whole middle), or within edit similarity ``min_similarity`` of the middle's first line.

Users differ in what they Tab, and so do projects' teams: a team that takes one line at a time dismisses every
multi-line block (``single_line``); a team that takes whole blocks dismisses every single line, and Tabs a block
whose first line is right, editing the rest (``whole_blocks``); a team that takes only suggestions worth the glance
dismisses a few characters (a higher ``min_prefix_chars``). Per-project adapters exist for such differences
(docs/demo.md, "Two projects"): ``single_line`` and ``whole_blocks`` pull one decision, whether to go on after the
first line, in opposite directions, so a policy shared by both teams is trained both ways.
"""

from __future__ import annotations

from dataclasses import dataclass
from difflib import SequenceMatcher

from onlinerl.loop.continue_filters import continue_shown


@dataclass(frozen=True)
class AcceptRule:
    min_prefix_chars: int = 4
    min_similarity: float = 0.8
    single_line: bool = False
    whole_blocks: bool = False

    def __post_init__(self) -> None:
        if self.single_line and self.whole_blocks:
            raise ValueError("single_line and whole_blocks exclude each other: such users would accept nothing")


def continue_postprocess(completion: str, prefix: str, suffix: str) -> str:
    """The text Continue shows for a raw completion (see :mod:`onlinerl.loop.continue_filters`)."""
    return continue_shown(completion, prefix, suffix)


def shown_text(completion: str) -> str:
    """Continue's final trim: trailing whitespace removed; it never shows a blank suggestion."""
    text = completion.rstrip()
    return text if text.strip() else ""


def edit_similarity(a: str, b: str) -> float:
    """Normalised similarity in [0, 1] (difflib ratio: 2*matches / total length)."""
    if not a and not b:
        return 1.0
    return SequenceMatcher(None, a, b, autojunk=False).ratio()


def first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


def decide(shown: str, middle: str, rule: AcceptRule = AcceptRule()) -> bool:
    """True when the simulated user accepts ``shown`` for the true ``middle``."""
    s = shown.strip()
    multi_line = "\n" in s
    if not s or (rule.single_line and multi_line) or (rule.whole_blocks and not multi_line):
        return False
    m = middle.strip()
    if m.startswith(s) and (len(s) >= rule.min_prefix_chars or s == m):
        return True
    judged = first_line(s) if rule.whole_blocks else s  # a block is taken for its first line, the rest is edited
    return edit_similarity(judged, first_line(middle)) >= rule.min_similarity
