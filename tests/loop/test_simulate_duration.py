"""`onlinerl simulate --duration S` runs for S seconds: before, the default ``--requests 100`` ended it first (a minute
or so on CPU), so a newcomer's ten-minute run stopped after 100 requests (found trying `make run` as a new user,
issue 36). An explicit ``--requests`` still caps it; with no limit the progress line counts instead of drawing a bar
towards 9223372036854775807."""

from __future__ import annotations

import sys

import pytest

from onlinerl.commands.simulate import DEFAULT_REQUESTS, requests_cap
from onlinerl.loop.simulate import Progress, SimulateTotals


@pytest.mark.parametrize(
    ("requests", "duration", "cap"),
    [(None, None, DEFAULT_REQUESTS), (None, 600.0, sys.maxsize), (50, 600.0, 50), (7, None, 7)],
)
def test_duration_alone_lifts_the_request_limit_and_requests_still_caps(requests, duration, cap) -> None:
    assert requests_cap(requests, duration) == cap


def drawn(total: int, capsys: pytest.CaptureFixture[str]) -> str:
    bar = Progress(total)
    bar.enabled = True  # as on a terminal
    bar.update(SimulateTotals(requests=12, shown=10, accepted=4, versions={0, 2}), force=True)
    return capsys.readouterr().err


def test_the_progress_line_counts_without_a_limit_and_draws_a_bar_with_one(capsys) -> None:
    assert drawn(sys.maxsize, capsys) == "\r12 requests accept=0.40 v=2 failed=0  "
    assert drawn(24, capsys) == f"\r[{'#' * 15:<30}] 12/24 accept=0.40 v=2 failed=0  "
