"""tests/reaper.py: a test process killed outright (SIGKILL, as `timeout -s KILL` or the OOM killer would) takes the
children it started with it; one it stopped itself is not touched again. Real processes: a stand-in test process
that starts ``Child`` processes through the wrapped product class, and its real watchdog."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from onlinerl.procs import wait_for

ROOT = Path(__file__).resolve().parents[2]

TEST_PROCESS = """
import sys, time
from pathlib import Path
from onlinerl.procs import Child
from tests.reaper import Reaper, reap_what_tests_start

reap_what_tests_start(Reaper())
logs = Path(sys.argv[1])
left = Child("left", ["sleep", "300"], logs / "left.log").start()  # never stopped: the kill must take it
done = Child("done", ["sleep", "300"], logs / "done.log").start()
done.stop(timeout=5)  # stopped by its owner: released
print(left.pid, done.pid, flush=True)
time.sleep(300)
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_a_killed_test_process_takes_what_it_started_with_it(tmp_path: Path) -> None:
    owner = subprocess.Popen(
        [sys.executable, "-c", TEST_PROCESS, str(tmp_path)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        left, done = (int(p) for p in owner.stdout.readline().split())
        assert alive(left) and not alive(done)
        owner.send_signal(signal.SIGKILL)  # no finally, no atexit, no sessionfinish
        owner.wait(10)
        wait_for(lambda: not alive(left), 15, what="the watchdog to stop the child its owner left behind")
    finally:
        owner.kill()
        owner.wait()
