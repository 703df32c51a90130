"""The simulated user's rule and the eval figures are exact and explicit."""

import orjson
import pytest

from onlinerl.loop.eval_metrics import EvalRecord, comparison_table, summarize
from onlinerl.loop.plots import plot_accept_rate, rolling_accept_rate, version_changes
from onlinerl.loop.user_model import AcceptRule, decide, edit_similarity, shown_text

MIDDLE = "result = compute(a, b)\n    return result"


@pytest.mark.parametrize(
    ("shown", "accepted"),
    [
        ("result = compute(a, b)", True),  # prefix of the middle
        ("resu", True),  # prefix of exactly 4 chars
        ("res", False),  # prefix too short
        ("result = compute(a, c)", True),  # within similarity 0.8 of the first line
        ("print('hello world')", False),
        ("   ", False),  # blank is never accepted
        ("", False),
        ("result = compute(a, b)\n    return result", True),  # the whole middle
    ],
)
def test_default_accept_rule(shown, accepted):
    assert decide(shown, MIDDLE) is accepted


def test_short_middle_accepted_whole():
    assert decide("x", "x")
    assert not decide("x", "xy", AcceptRule(min_prefix_chars=4, min_similarity=0.99))


def test_team_habits_change_the_verdict():
    """A team that Tabs a line at a time dismisses a correct block; one that Tabs only what is worth the glance
    dismisses a correct few characters, yet still takes a short middle whole."""
    one_line = AcceptRule(single_line=True)
    assert decide("result = compute(a, b)", MIDDLE, one_line)
    assert not decide(MIDDLE, MIDDLE, one_line) and decide(MIDDLE, MIDDLE)
    worth_it = AcceptRule(min_prefix_chars=20)
    assert not decide("result = ", MIDDLE, worth_it) and decide("result = ", MIDDLE)
    assert decide("result = compute(a, ", MIDDLE, worth_it)  # 20 characters
    assert decide("x = 1", "x = 1", worth_it)  # the whole middle


def test_whole_blocks_is_the_opposite_habit_of_single_line():
    """A team that takes whole blocks dismisses any single line, even the exact middle, and Tabs a block whose first
    line is right though the rest is not (it edits the rest); a block that starts wrong is dismissed. On the same
    suggestions the single-line team decides the other way: one choice, stop after the first line or go on, is
    rewarded in opposite directions."""
    blocks = AcceptRule(whole_blocks=True)
    one_line = AcceptRule(single_line=True)
    right_start = "result = compute(a, b)\n    log(result)"  # the first line right, the second not the middle's
    assert decide(right_start, MIDDLE, blocks) and not decide(right_start, MIDDLE, one_line)
    assert decide(MIDDLE, MIDDLE, blocks) and not decide(MIDDLE, MIDDLE, one_line)
    assert not decide("result = compute(a, b)", MIDDLE, blocks) and decide("result = compute(a, b)", MIDDLE, one_line)
    assert not decide("x = 1", "x = 1", blocks)  # a single line, even the whole middle
    assert not decide("print('hello world')\n    return result", MIDDLE, blocks)  # starts wrong
    assert not decide("result = compute(a, b)\n    log(result)", MIDDLE)  # the default user judges the whole block
    with pytest.raises(ValueError, match="exclude each other"):
        AcceptRule(single_line=True, whole_blocks=True)


def test_shown_text_trims_like_continue():
    assert shown_text("foo()  \n\n") == "foo()"
    assert shown_text(" \n ") == ""
    assert edit_similarity("abc", "abc") == 1.0 and edit_similarity("abc", "xyz") == 0.0


def test_summary_figures():
    recs = [
        EvalRecord("1", "alpha = 1", "alpha = 1"),  # accepted, exact
        EvalRecord("2", "beta = 2", "gamma"),  # shown, rejected
        EvalRecord("3", "delta = 4", ""),  # silent
        EvalRecord("4", "eps = 5", "", failed=True),
    ]
    s = summarize(recs)
    assert (s.requests, s.failed, s.shown, s.accepted) == (4, 1, 2, 1)
    assert s.accept_rate == 0.5 and s.suggestion_rate == 0.5 and s.accepted_per_100 == 25.0
    assert s.exact_match == pytest.approx(1 / 3)
    table = comparison_table({"v0": s, "v3": s})
    assert "| simulated accept rate | 0.500 | 0.500 |" in table


def test_timeline_plot(tmp_path):
    rows = [{"t": i, "shown": "x" if i % 2 else "y", "accepted": i > 50, "version": i // 40} for i in range(120)]
    path = tmp_path / "timeline.jsonl"
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    _, ys = rolling_accept_rate(rows, window=10)
    assert ys[0] == 0.0 and ys[-1] == 1.0
    assert version_changes(rows) == [(41, 1), (81, 2)]
    png = plot_accept_rate(path, tmp_path / "p.png", window=10)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
