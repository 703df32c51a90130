"""Continue's display pipeline, case by case: what the simulated user is shown decides every reward."""

from __future__ import annotations

from onlinerl.loop.continue_filters import (
    continue_shown,
    cut_at_start_of_suffix,
    is_extreme_repetition,
    levenshtein,
    line_is_repeated,
    should_complete_multiline,
)

BODY_PREFIX = "def f(a):\n    "


def test_multiline_only_at_end_of_line_and_outside_comments():
    assert should_complete_multiline("x = ", "\nprint(x)\n")
    assert not should_complete_multiline("x = ", ")\nprint(x)\n")  # text after the cursor: single line
    assert not should_complete_multiline("x = ", "")  # end of file has no newline after the cursor
    assert not should_complete_multiline("    # explain ", "\nx = 1\n")


def test_single_line_mode_cuts_at_the_first_newline():
    assert continue_shown("compute(a)\n    more()", "x = f(", ")\n") == "compute(a)"
    assert continue_shown("\n    other()", "x = f(", ")\n") == ""  # starts with a newline: nothing shown


def test_a_blank_line_ends_a_multiline_suggestion():
    shown = continue_shown("a = 1\n    b = 2\n\n    c = 3", BODY_PREFIX, "\n    return b\n")
    assert shown == "a = 1\n    b = 2"
    # a blank *first* line is allowed (the suggestion starts on the next line)
    assert continue_shown("\n    b = 2\n\nx", "    a = 1", "\n") == "\n    b = 2"


def test_stops_at_the_line_below_the_cursor_exact_or_similar():
    suffix = "\n    return total\n"
    assert continue_shown("total = a + 1\n    return total\n", BODY_PREFIX, suffix) == "total = a + 1"
    assert continue_shown("total = a + 1\n    return totals\n", BODY_PREFIX, suffix) == "total = a + 1"
    # the exact line below stops; the same bracket line with other indentation is let through
    assert continue_shown("x = [\n    1,\n]\nmore", "", "\n]\n") == "x = [\n    1,"
    assert continue_shown("x = [\n    1,\n]\nmore", "", "\n    ]\n") == "x = [\n    1,\n]\nmore"


def test_repeats_are_hidden_and_the_third_stops():
    assert continue_shown("a = 1\na = 1\nb = 2", BODY_PREFIX, "\n") == "a = 1\nb = 2"
    assert continue_shown("a = 1\na = 1\na = 1\nb = 2", BODY_PREFIX, "\n") == "a = 1"


def test_stop_at_the_start_of_the_suffix():
    suffix = "\n    return compute_total(items, tax)\n"
    raw = "x = 1\n    return compute_total(items, tax)"
    assert cut_at_start_of_suffix(raw, suffix) == "x = 1\n    "
    assert continue_shown(raw, BODY_PREFIX, suffix) == "x = 1"
    assert cut_at_start_of_suffix("anything", "short") == "anything"  # suffix under 20 chars: no check


def test_postprocessing_hides_whitespace_and_rewrites_of_the_line_above():
    assert continue_shown("   \n  ", BODY_PREFIX, "\n") == ""
    assert continue_shown("result = compute(a)", "    result = compute(a)\n    ", "\n") == ""
    assert continue_shown(" 1", "x = ", "\n") == "1"  # the prefix already ends with a space


def test_comment_only_and_path_lines_are_dropped():
    assert continue_shown("#\n    a = 1", BODY_PREFIX, "\n") == "    a = 1"
    assert continue_shown("# Path: x.py\na = 1", "", "\n") == "a = 1"
    assert continue_shown("a = 1\n# End of file.\nb", "", "\n") == "a = 1"


def test_helpers():
    assert levenshtein("kitten", "sitting") == 3
    assert line_is_repeated("return total_value", "return total_values")
    assert not line_is_repeated("abc", "abc")  # too short to count
    assert is_extreme_repetition("\n".join(["print(value_1)"] * 7))
    assert not is_extreme_repetition("a\nb\nc")
