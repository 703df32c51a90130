"""Whatever a test process starts dies with it, however it ends (issue 40's note: a ``timeout``-killed pytest left its
shared vLLM engines running, a core each, and the next run measured against them).

Fixtures and ``pytest_sessionfinish`` stop what tests start, but only when pytest ends on its own: SIGTERM (``timeout``,
a CI runner), SIGKILL or a crash skip them, and the children live on, because each runs in its own session
(``onlinerl.procs.Child``) so that a terminal's Ctrl-C cannot reach them. :class:`Reaper` is one watchdog process per
test process (the xdist controller and each worker): every child started is registered with it, every child stopped
unregistered, over a pipe to the watchdog's stdin. When that pipe closes, the test process is gone; the watchdog then
sends SIGTERM to what is still registered, and SIGKILL 10 s later to what is left. A normal end leaves nothing
registered, so the watchdog just exits.
"""

from __future__ import annotations

import subprocess
import sys
import threading

# "+g<pgid>" / "-g<pgid>": a process group (a Child: its own session). "+p<pid>" / "-p<pid>": one process (a
# valkey-server, which may share the test process's group: that must not be signalled whole). End of input: the test
# process is gone.
WATCHDOG = r"""
import os, signal, sys, time

kill = {"g": os.killpg, "p": os.kill}
held = set()
for line in sys.stdin:
    entry = (line[1], int(line[2:]))
    (held.add if line[0] == "+" else held.discard)(entry)

def alive(entry):
    try:
        kill[entry[0]](entry[1], 0)
        return True
    except OSError:
        return False

for sig in (signal.SIGTERM, signal.SIGKILL):
    held = {e for e in held if alive(e)}
    for kind, number in held:
        try:
            kill[kind](number, sig)
        except OSError:
            pass
    deadline = time.monotonic() + 10
    while held and time.monotonic() < deadline:
        time.sleep(0.2)
        held = {e for e in held if alive(e)}
"""


class Reaper:
    """The watchdog of this test process; :meth:`hold` a started child, :meth:`release` it once stopped."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # the engine pool starts engines from a thread of its own
        self._watchdog = subprocess.Popen(
            [sys.executable, "-c", WATCHDOG],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C to pytest's group must not end it before pytest's own exit
            text=True,
        )

    def hold(self, number: int, group: bool) -> None:
        self._send(f"+{'g' if group else 'p'}{number}\n")

    def release(self, number: int, group: bool) -> None:
        self._send(f"-{'g' if group else 'p'}{number}\n")

    def _send(self, line: str) -> None:
        stdin = self._watchdog.stdin
        assert stdin is not None
        with self._lock:
            try:
                stdin.write(line)
                stdin.flush()
            except (BrokenPipeError, ValueError):  # the watchdog died: nothing to reap with, the tests go on
                pass


def reap_what_tests_start(reaper: Reaper) -> None:
    """Register every ``Child`` (its process group) and every ``EmbeddedValkey`` (its server process) this test
    process starts, and release each once stopped. A wrapper around their start and stop, for the test session only:
    what they do is unchanged."""
    from onlinerl.procs import Child
    from onlinerl.valkey import EmbeddedValkey

    start, wait_stopped, kill = Child.start, Child.wait_stopped, Child.kill

    def child_start(self: Child) -> Child:
        started = start(self)
        reaper.hold(self.pid, group=True)
        return started

    def child_wait_stopped(self: Child, timeout: float) -> int | None:
        try:
            return wait_stopped(self, timeout)
        finally:
            if self.proc is not None and not self.alive():
                reaper.release(self.pid, group=True)

    def child_kill(self: Child) -> None:
        kill(self)
        if self.proc is not None and not self.alive():
            reaper.release(self.pid, group=True)

    Child.start, Child.wait_stopped, Child.kill = child_start, child_wait_stopped, child_kill  # type: ignore[method-assign]

    v_start, v_stop, v_kill = EmbeddedValkey.start, EmbeddedValkey.stop, EmbeddedValkey.kill

    def valkey_start(self: EmbeddedValkey, timeout: float = 20.0) -> EmbeddedValkey:
        started = v_start(self, timeout)
        if self.process is not None:
            reaper.hold(self.process.pid, group=False)
        return started

    def valkey_ended(end):  # stop or kill: release the server that was running
        def ended(self: EmbeddedValkey) -> None:
            pid = None if self.process is None else self.process.pid
            end(self)
            if pid is not None:
                reaper.release(pid, group=False)

        return ended

    EmbeddedValkey.start = valkey_start  # type: ignore[method-assign]
    EmbeddedValkey.stop, EmbeddedValkey.kill = valkey_ended(v_stop), valkey_ended(v_kill)  # type: ignore[method-assign]
