"""Child processes for `onlinerl up` and the tests: start with a log file, wait on a condition, stop cleanly.

Waiting is always on a condition with a deadline (an HTTP health check or a predicate), never a bare sleep.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx


class StartupError(RuntimeError):
    """A child process died or did not become healthy in time; the message carries its log tail."""


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "<no log>"


def wait_for(predicate: Callable[[], bool], timeout: float, interval: float = 0.05, what: str = "condition") -> None:
    """Poll ``predicate`` until true; raise TimeoutError naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")


def http_ok(url: str, timeout: float = 1.0) -> bool:
    """One health probe. A plain-HTTP probe skips loading the CA bundle (16 ms of CPU per client on a busy 2-core
    box, paid on every poll of a start-up wait); an https one still verifies."""
    try:
        return httpx.get(url, timeout=timeout, verify=not url.startswith("http://")).status_code == 200
    except httpx.HTTPError:
        return False


@dataclass
class Child:
    """One child process in its own process group (so stop() also ends its children)."""

    name: str
    argv: Sequence[str]
    log_path: Path
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: str | None = None
    proc: subprocess.Popen | None = None
    health_url: str | None = None  # set once healthy: the supervisor says when a restarted child is healthy again

    def start(self) -> Child:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child for its lifetime
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        self.proc = subprocess.Popen(
            list(self.argv),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=self.cwd,
            start_new_session=True,
            stdin=subprocess.DEVNULL,
        )
        log.close()
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_healthy(self, url: str, timeout: float) -> Child:
        """Wait for ``url`` to answer 200; fail fast (with the log tail) if the process dies first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise StartupError(f"{self.name} exited with {self.proc.returncode}:\n{log_tail(self.log_path)}")
            if http_ok(url):
                self.health_url = url
                return self
            time.sleep(0.2)
        raise StartupError(f"{self.name} not healthy at {url} after {timeout:.0f}s:\n{log_tail(self.log_path)}")

    def signal(self, sig: int) -> None:
        if self.alive():
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM the group, then SIGKILL after ``timeout``; returns the exit code."""
        self.signal(signal.SIGTERM)
        return self.wait_stopped(timeout)

    def wait_stopped(self, timeout: float) -> int | None:
        """Wait for the child to exit (it was told to), SIGKILL the group after ``timeout``; the exit code."""
        if self.proc is None:
            return None
        if self.alive():
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.proc.wait(5)
        self.reap_group()
        return self.proc.returncode

    def reap_group(self) -> None:
        """SIGKILL what is left of a dead child's process group: a leader killed with -9 (OOM killer, a crash) leaves
        its own children running (vLLM's engine-core process holds the model and CPU), and a restart must not stack
        a second copy on top. The group id cannot be reused while any member lives, so this hits only our orphans."""
        if self.proc is None or self.alive():
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def kill(self) -> None:
        """SIGKILL the group at once (crash tests)."""
        self.signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(10)


def python_module(module: str, *args: str) -> list[str]:
    """argv running ``python -m module`` with this interpreter (the venv's)."""
    return [sys.executable, "-m", module, *args]


@dataclass
class _Book:
    failures: int = 0  # consecutive deaths, each within ``stable_after_s`` of its start
    started_at: float = 0.0
    restart_at: float | None = None  # scheduled restart (monotonic), None when running
    awaiting_health: bool = False


def stop_all(children: Sequence[Child], timeout: float = 15.0) -> None:
    """SIGTERM every live child at once, then wait for each; SIGKILL whatever is still up ``timeout`` after that.

    Why at once: stopping one after another waited out each Python service's shutdown in turn, 12-13 s for a whole
    local stack on the 2-core VM (Ctrl-C on `onlinerl up`, and every test that starts one). The children shut down
    independently (each its own process group, Redis still up until they are all gone), so the stack is down in the
    time of the slowest one."""
    live = [c for c in children if c.alive()]
    for child in live:
        child.signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for child in live:
        child.wait_stopped(max(0.0, deadline - time.monotonic()))


@dataclass
class Supervisor:
    """Keeps children running: a child that dies is restarted after an exponential backoff, with a line saying so.

    A child that stayed up ``stable_after_s`` earns a fresh count; ``max_restarts`` deaths in a row, each soon after
    its start, mean it cannot run here, and :meth:`poll` returns why so the caller stops everything instead of
    restarting for ever. ``poll`` never blocks: the caller's loop calls it about once a second.
    """

    children: list[Child]
    say: Callable[[str], None]
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    max_restarts: int = 5
    stable_after_s: float = 60.0
    clock: Callable[[], float] = time.monotonic
    books: dict[str, _Book] = field(default_factory=dict)

    def _book(self, child: Child) -> _Book:
        if child.name not in self.books:
            self.books[child.name] = _Book(started_at=self.clock())
        return self.books[child.name]

    def delay(self, failures: int) -> float:
        """Backoff before restart number ``failures`` (1-based): backoff_s, 2x, 4x ... capped at max_backoff_s."""
        return min(self.max_backoff_s, self.backoff_s * 2 ** max(0, failures - 1))

    def poll(self) -> str | None:
        """Restart what died and is due; returns a message when a child failed too often (the caller stops)."""
        now = self.clock()
        for child in self.children:
            book = self._book(child)
            if book.restart_at is not None:
                if now >= book.restart_at:
                    child.start()
                    book.restart_at, book.started_at, book.awaiting_health = None, now, child.health_url is not None
                    self.say(f"{child.name} restarted (pid {child.pid}, restart {book.failures}/{self.max_restarts})")
                continue
            if child.alive():
                if book.awaiting_health and child.health_url and http_ok(child.health_url, timeout=0.5):
                    book.awaiting_health = False
                    self.say(f"{child.name} healthy again")
                if now - book.started_at >= self.stable_after_s:
                    book.failures = 0
                continue
            code = child.proc.returncode if child.proc is not None else None
            child.reap_group()
            book.failures = book.failures + 1 if now - book.started_at < self.stable_after_s else 1
            tail = log_tail(child.log_path, 15)
            if book.failures > self.max_restarts:
                return (
                    f"{child.name} exited with {code} {book.failures} times in a row, each within "
                    f"{self.stable_after_s:.0f}s of its start: giving up; last log lines:\n{tail}"
                )
            wait = self.delay(book.failures)
            book.restart_at = now + wait
            self.say(
                f"{child.name} exited unexpectedly with {code}; restarting in {wait:.0f}s "
                f"(restart {book.failures}/{self.max_restarts}); last log lines:\n{tail}"
            )
        return None
