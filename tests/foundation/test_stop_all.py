"""``procs.stop_all``: a local stack's children are told to stop at once and waited for together.

Each child here takes a second to shut down after SIGTERM, as a Python service does: all three are told before the
first has finished, so they are down in the time of one, not three. A child that ignores SIGTERM is killed when the
shared deadline passes, and the others still get their whole graceful stop (each exits 0, its handler ran once).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from onlinerl.procs import Child, stop_all, wait_for

GRACEFUL = """
import signal, sys, time
def bye(*_):
    print("told", time.time(), flush=True)
    time.sleep(1.0)  # a service's orderly shutdown: flush, close, publish
    print("stopped", time.time(), flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, bye)
print("ready", flush=True)
while True:
    time.sleep(0.05)
"""

STUBBORN = """
import signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ready", flush=True)
while True:
    time.sleep(0.05)
"""


def stamps(children: list[Child], word: str) -> list[float]:
    return [
        float(line.split()[1])
        for c in children
        for line in c.log_path.read_text().splitlines()
        if line.startswith(word)
    ]


def start(tmp_path: Path, name: str, code: str) -> Child:
    child = Child(name, [sys.executable, "-c", code], tmp_path / f"{name}.log").start()
    wait_for(lambda: "ready" in child.log_path.read_text(), 20, what=f"{name} to start")
    return child


def test_children_stop_together_and_a_stubborn_one_is_killed_at_the_deadline(tmp_path: Path) -> None:
    graceful = [start(tmp_path, f"service-{i}", GRACEFUL) for i in range(3)]
    stop_all(graceful)
    assert all(c.proc is not None and c.proc.returncode == 0 for c in graceful)
    told, stopped = stamps(graceful, "told"), stamps(graceful, "stopped")
    assert len(told) == len(stopped) == 3  # one SIGTERM each: a second one would cut a graceful stop short
    assert max(told) < min(stopped), "a child was told to stop only after another had finished"

    stubborn = start(tmp_path, "stubborn", STUBBORN)
    polite = start(tmp_path, "polite", GRACEFUL)
    t0 = time.monotonic()
    stop_all([stubborn, polite], timeout=2.0)
    took = time.monotonic() - t0
    assert stubborn.proc is not None and stubborn.proc.returncode == -9  # SIGKILL at the deadline
    assert polite.proc is not None and polite.proc.returncode == 0
    assert 1.9 <= took < 6, took
