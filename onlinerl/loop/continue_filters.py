"""What Continue shows for a raw completion: its multi-line decision, stream filters and post-processing, for Python.

The simulated user must see what a real Continue user sees, or the reward would teach the model about a client that
does not exist. This follows Continue's autocomplete pipeline (``core/autocomplete``), in its order:

1. ``shouldCompleteMultiline``: single-line when the cursor has text after it on its line (the suffix does not start
   with a newline) or sits in a ``#`` comment; otherwise multi-line.
2. Single-line: the stream is cut at the first newline, so a completion that starts with one shows nothing.
3. Character filters: the request's stop strings, then ``stopAtStartOf`` (stop where the completion starts to
   reproduce the first 30 characters of the suffix, in 20-character windows).
4. Line filters: ``stopAtLines`` (``# End of file.``), ``stopAtLinesExact`` (the line below the cursor),
   ``stopAtRepeatingLines`` (the 3rd identical line in a row; repeats are not shown), ``avoidEmptyComments``,
   ``avoidPathLine``, ``noDoubleNewLine`` (a blank line after the first ends the suggestion) and
   ``stopAtSimilarLine`` (a line within Levenshtein 10% of the line below the cursor).
5. ``postprocessCompletion``: nothing is shown for whitespace only, for a first line that repeats the line above, or
   for extreme repetition; a leading space is dropped when the prefix already ends with one.

Streaming is modelled character by character, so chunk boundaries never change the result.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

SINGLE_LINE_COMMENT = "#"
LINES_TO_STOP_AT = ("# End of file.", "<STOP EDITING HERE")
STOP_AT_START_OF_SUFFIX_CHARS = 20
MAX_REPEATING_LINES = 3
BRACKET_ENDING_CHARS = frozenset(")]};")


def should_complete_multiline(prefix: str, suffix: str) -> bool:
    """Continue's rule: multi-line only at the end of a line (suffix starts with a newline), never in a comment."""
    if not suffix.startswith("\n"):
        return False
    return not prefix.split("\n")[-1].lstrip().startswith(SINGLE_LINE_COMMENT)


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insert, delete, substitute), two-row dynamic programme."""
    if len(a) < len(b):
        a, b = b, a
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def line_is_repeated(a: str, b: str) -> bool:
    """Continue's ``lineIsRepeated``: both longer than 4 characters and within 10% edit distance of ``b``."""
    if len(a) <= 4 or len(b) <= 4:
        return False
    a, b = a.strip(), b.strip()
    return levenshtein(a, b) / max(1, len(b)) < 0.1


def line_below_cursor(suffix: str) -> str:
    """The first non-blank line after the cursor's own line (Continue skips blank lines), or ``""``."""
    for line in suffix.split("\n")[1:]:
        if line.strip():
            return line
    return ""


def cut_at_stop_strings(text: str, stop: Iterable[str]) -> str:
    cut = len(text)
    for s in stop:
        if s:
            i = text.find(s)
            if i >= 0:
                cut = min(cut, i)
    return text[:cut]


def cut_at_start_of_suffix(text: str, suffix: str, window: int = STOP_AT_START_OF_SUFFIX_CHARS) -> str:
    """``stopAtStartOf``: stop before the first ``window``-character run that appears in the suffix's start."""
    if len(suffix) < window:
        return text
    target = suffix.lstrip()[: int(window * 1.5)]
    for i in range(0, len(text) - window + 1):
        if text[i : i + window] in target:
            return text[:i]
    return text


def filter_lines(lines: Sequence[str], below: str) -> list[str]:
    """Continue's line filters in their order; returns the lines shown."""
    out: list[str] = []
    previous: str | None = None
    repeats = 0
    below_trim = below.strip()
    below_brackets = any(c in BRACKET_ENDING_CHARS for c in below_trim)
    for line in lines:
        if any(_stop_phrase_at(line, p) for p in LINES_TO_STOP_AT):
            break
        if below_trim and line == below:
            break
        if line == previous:
            repeats += 1
            if repeats == MAX_REPEATING_LINES:
                break
            continue
        previous, repeats = line, 1
        if line.strip() == SINGLE_LINE_COMMENT or line.startswith(f"{SINGLE_LINE_COMMENT} Path: "):
            continue
        if out and not line.strip():
            break  # noDoubleNewLine: a blank line after the first one ends the suggestion
        similar = line == below or line_is_repeated(line, below_trim)
        if below_trim and similar and not (below_brackets and line.strip() == below_trim):
            break
        out.append(line)
    return out


def _stop_phrase_at(line: str, phrase: str) -> bool:
    """``stopAtLines``: the phrase at the line's logical start, or after whitespace, and not inside quotes."""
    i = line.find(phrase)
    if i < 0:
        return False
    before = line[:i]
    if i > 0 and not line[i - 1].isspace():
        return False
    return not (before.count("'") % 2 or before.count('"') % 2)


def rewrites_line_above(completion: str, prefix: str) -> bool:
    above = next((ln for ln in reversed(prefix.split("\n")) if ln.strip()), "")
    first = next((ln for ln in completion.split("\n") if ln.strip()), "")
    return bool(above and first) and line_is_repeated(above, first)


def is_extreme_repetition(completion: str) -> bool:
    """Six or more lines where one pattern (every line, or every other line) covers most of them."""
    lines = completion.split("\n")
    if len(lines) < 6:
        return False
    for freq in (1, 2):
        common = _longest_common_substring(lines[0], lines[freq])
        if len(common) > 5 or len(common) > len(lines[0]) * 0.5:
            matches = sum(common in lines[i] for i in range(0, len(lines), freq))
            if matches * freq > 8 or matches * freq / len(lines) > 0.8:
                return True
    return False


def _longest_common_substring(a: str, b: str) -> str:
    best, best_end = 0, 0
    prev = [0] * (len(b) + 1)
    for i, ca in enumerate(a, 1):
        cur = [0] * (len(b) + 1)
        for j, cb in enumerate(b, 1):
            if ca == cb:
                cur[j] = prev[j - 1] + 1
                if cur[j] > best:
                    best, best_end = cur[j], i
        prev = cur
    return a[best_end - best : best_end]


def continue_shown(completion: str, prefix: str, suffix: str, stop: Iterable[str] = ()) -> str:
    """The suggestion Continue displays for ``completion`` at a cursor between ``prefix`` and ``suffix``; ``""``
    when it displays nothing."""
    text = completion
    if not should_complete_multiline(prefix, suffix):
        text = text.split("\n", 1)[0]
    text = cut_at_stop_strings(text, stop)
    text = cut_at_start_of_suffix(text, suffix)
    text = "\n".join(filter_lines(text.split("\n"), line_below_cursor(suffix)))
    if not text.strip() or rewrites_line_above(text, prefix) or is_extreme_repetition(text):
        return ""
    last_prefix_line = prefix.split("\n")[-1]
    if last_prefix_line.strip() and prefix.endswith(" ") and text.startswith(" "):
        text = text[1:]
    return text.rstrip()
