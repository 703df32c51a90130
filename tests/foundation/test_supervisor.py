"""`onlinerl up`'s supervisor on real child processes: a child killed with SIGKILL comes back (and a line says so);
one that keeps dying right after its start makes the stack stop with its log tail, after bounded restarts."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from onlinerl.procs import Child, Supervisor, http_ok, wait_for
from onlinerl.valkey import free_port


def drive(sup: Supervisor, until, timeout: float, what: str) -> list[str | None]:
    """Call ``poll`` like run_forever does until ``until()``; returns what poll returned each time."""
    results: list[str | None] = []

    def step() -> bool:
        results.append(sup.poll())
        return until()

    wait_for(step, timeout, interval=0.05, what=what)
    return results


def test_a_killed_child_is_restarted_and_healthy_again(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    child = Child(
        "feedback", [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"], tmp_path / "fb.log"
    )
    lines: list[str] = []
    sup = Supervisor([child.start()], lines.append, backoff_s=0.2)
    try:
        child.wait_healthy(url, 20)
        first = child.pid
        assert sup.poll() is None and lines == []  # nothing to do while it runs
        os.kill(first, signal.SIGKILL)
        results = drive(sup, lambda: any("healthy again" in m for m in lines), 20, "the child to be healthy again")
        assert all(r is None for r in results)  # one crash never stops the stack
        assert child.alive() and child.pid != first and http_ok(url)
        assert lines[0].startswith("feedback exited unexpectedly with -9; restarting in 0s (restart 1/5)")
        assert lines[1] == f"feedback restarted (pid {child.pid}, restart 1/5)"
        assert lines[2] == "feedback healthy again" and len(lines) == 3
    finally:
        child.stop()


def test_a_child_that_keeps_dying_stops_the_stack_after_bounded_restarts(tmp_path: Path) -> None:
    code = "import sys; print('bad config: trainer.lr must be > 0', flush=True); sys.exit(3)"
    child = Child("trainer", [sys.executable, "-c", code], tmp_path / "trainer.log")
    lines: list[str] = []
    sup = Supervisor([child.start()], lines.append, backoff_s=0.05, max_restarts=2)
    results = drive(sup, lambda: sup.books["trainer"].failures > 2, 30, "the supervisor to give up")
    fatal = results[-1]
    assert fatal is not None and fatal.startswith("trainer exited with 3 3 times in a row")
    assert "bad config: trainer.lr must be > 0" in fatal  # the log tail says why
    assert sum("restarted" in m for m in lines) == 2 and all(r is None for r in results[:-1])
    assert not child.alive()


def test_backoff_doubles_up_to_its_cap_and_a_stable_run_earns_a_fresh_count(tmp_path: Path) -> None:
    sup = Supervisor([], print, backoff_s=1.0, max_backoff_s=30.0)
    assert [sup.delay(n) for n in range(1, 8)] == [1, 2, 4, 8, 16, 30, 30]
    now = [0.0]
    child = Child("rollout", [sys.executable, "-c", "import time; time.sleep(30)"], tmp_path / "r.log")
    lines: list[str] = []
    sup = Supervisor([child.start()], lines.append, backoff_s=0.0, stable_after_s=60, clock=lambda: now[0])
    try:
        for expected in (1, 2):  # two quick deaths in a row
            child.kill()
            assert sup.poll() is None and sup.books["rollout"].failures == expected
            assert sup.poll() is None and child.alive()  # restarted (backoff 0)
        now[0] += 61  # it then runs a minute
        assert sup.poll() is None and sup.books["rollout"].failures == 0
        child.kill()
        assert sup.poll() is None and sup.books["rollout"].failures == 1 and "restart 1/5" in lines[-1]
    finally:
        child.stop()
