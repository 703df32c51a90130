"""The simulated Continue user: what it is shown, and whether it presses Tab.

Pure functions, so the rule the demonstration is judged by is explicit and tested. Default rule: accept when the
shown text (trimmed) is non-empty and either a prefix of the true middle of at least ``min_prefix_chars`` characters
(or the whole middle), or within edit similarity ``min_similarity`` of the middle's first line.
"""

from __future__ import annotations

from dataclasses import dataclass
from difflib import SequenceMatcher


@dataclass(frozen=True)
class AcceptRule:
    min_prefix_chars: int = 4
    min_similarity: float = 0.8


def is_midline(prefix: str) -> bool:
    """Cursor after code on its line: Continue's ``multilineCompletions: auto`` then completes a single line."""
    return prefix.rsplit("\n", 1)[-1].strip() != ""


def continue_postprocess(completion: str, prefix: str, suffix: str, max_lines: int = 50) -> str:
    """The text Continue shows for a raw completion (its stream filters, simplified but in the same order).

    Single-line mode (mid-line cursor): a completion starting with a newline shows nothing (noFirstCharNewline),
    otherwise it is cut at the first newline (stopAtLines). Multi-line mode: stop before a line that repeats the
    previous one (stopAtRepeatingLines) or equals the next line of the suffix (stopAtSimilarLine), at most
    ``max_lines`` lines. Trailing whitespace is trimmed; a blank result is not shown.
    """
    if is_midline(prefix):
        if completion.startswith(("\n", "\r\n")):
            return ""
        return shown_text(completion.split("\n", 1)[0])
    next_line = next((ln.strip() for ln in suffix.split("\n") if ln.strip()), "")
    out: list[str] = []
    for line in completion.split("\n")[:max_lines]:
        if out and line.strip() and (line == out[-1] or line.strip() == next_line):
            break
        out.append(line)
    return shown_text("\n".join(out))


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
    if not s:
        return False
    m = middle.strip()
    if m.startswith(s) and (len(s) >= rule.min_prefix_chars or s == m):
        return True
    return edit_similarity(s, first_line(middle)) >= rule.min_similarity
