"""Blue/green end to end in full-weight mode, with no simulator writing statistics: every counter comes from the real
components.

Real valkey, real vLLM on CPU holding one version at a time (tiny random model, full weights, dev mode), the real
gateway, reloader and feedback service, and the real controller process (``python -m onlinerl_rollout``) under the
strategy full-weight mode defaults to (``bluegreen``: the config does not name one). v0 (the base model) is stable.
A scripted user population (one API key per user) runs as 8 concurrent streaming clients throughout, each sending
Continue's exact streaming request and upload and accepting by the version the gateway says served it
(``X-OnlineRL-Policy-Version``): v0 30 %, v1 75 %, v2 3 %.

v1 passes the gate, the reloader swaps vLLM's weights to it (everyone, arm ``candidate``), the watch compares its live
figures with v0's snapshot and keeps it; v2 is switched to the same way and switched back automatically on its live
regression. Zero requests fail through the switches, and the test prints the feedback events each decision took.

The gate runs with a fixed evaluator (``tests.rollout.evaluators:plain_code``): the gate's evaluation through the
real gateway pins each version by header, which one-version-at-a-time serving answers 409 for the version it does not
hold (tests/rollout/test_e2e_real.py covers the gate's real path under LoRA). Here the gate's place in the sequence
(gate, then switch) is what is checked.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import redis

from onlinerl.arms import CANDIDATE, STABLE
from onlinerl.auth import write_keys_file
from onlinerl.config import from_mapping
from onlinerl.fim import get_template
from onlinerl.keys import Keys
from onlinerl.loop.continue_client import ContinueClient
from onlinerl.loop.status import collect, render
from onlinerl.procs import Child, python_module
from onlinerl.rollout.records import DecisionRecord
from onlinerl.rollout.store import RolloutStore
from onlinerl.schemas import PolicyTable
from onlinerl.valkey import EmbeddedValkey, free_port
from onlinerl_serving.engine import start_vllm
from tests.serving.conftest import JOB, start_gateway, start_reloader, write_config
from tests.serving.test_full_weights import announce, write_full_checkpoint

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

USERS = 24
CLIENTS = 8
TENANT = "acme"
ACCEPT = {0: 0.30, 1: 0.75, 2: 0.03}
MIN_SAMPLES = 16
QWEN = get_template("qwen")
CODE = [
    ("def add(a, b):\n    return ", "\n\nprint(add(1, 2))\n"),
    ("import os\npath = os.path.", "\n"),
    ("for i in range(", "):\n    pass\n"),
    ("class A:\n    def __init__(self):\n        self.", "\n"),
    ("values = [1, 2, 3]\ntotal = sum(", ")\n"),
]


@dataclass
class Stack:
    redis: redis.Redis
    store: RolloutStore
    gateway_url: str
    feedback_url: str
    reloader_url: str
    controller_url: str
    user_keys: list[str]
    paths: dict[int, Path]

    def table(self) -> PolicyTable:
        return self.store.policy()

    def holding(self) -> int | None:
        return httpx.get(f"{self.reloader_url}/healthz", timeout=5).json()["holding"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("bluegreen-e2e")
    user_keys = [f"sk-user-{i:02d}-0123456789" for i in range(USERS)]
    keys_file = write_keys_file(tmp / "keys.yaml", {TENANT: user_keys})
    valkey = EmbeddedValkey(tmp / "valkey").start()
    engine_port, gw_port, rl_port, fb_port, ctl_port = (free_port() for _ in range(5))
    sections = dict(
        redis={"url": valkey.url},
        auth={"apiKeysFile": str(keys_file)},
        model={"path": str(tiny_model_path), "maxModelLen": 1024, "fimTemplate": "qwen"},
        trainer={"weights": "full"},
        storage={"checkpointDir": str(tmp / "ckpt")},
        serving={
            "host": "127.0.0.1",
            "port": gw_port,
            "engineUrl": f"http://127.0.0.1:{engine_port}",
            "weightsMode": "full",
            "drainTimeoutSeconds": 30,
        },
        feedback={"host": "127.0.0.1", "port": fb_port},
        rollout={"minSamples": MIN_SAMPLES, "minDwellSeconds": 0, "gate": {"evalSamples": 16}},  # no strategy named
    )
    cfg_path = write_config(tmp / "config.yaml", **sections)
    cfg = from_mapping({"job": JOB, **sections})
    assert cfg.rollout.strategy == "bluegreen", "full-weight mode defaults to blue/green"
    env = {
        "ONLINERL_CONFIG": str(cfg_path),
        "OMP_NUM_THREADS": "1",
        "ONLINERL_ROLLOUT_EVALUATOR": "tests.rollout.evaluators:plain_code",
    }
    children: list[Child] = []
    r = redis.Redis.from_url(valkey.url)
    try:
        children.append(start_vllm(cfg, tiny_model_path, tmp / "vllm.log", port=engine_port))
        children.append(start_gateway(cfg_path, tmp / "gateway.log", gw_port).child)
        children.append(start_reloader(cfg_path, tmp / "reloader.log", rl_port))
        feedback = Child("feedback", python_module("onlinerl_feedback"), tmp / "feedback.log", env=env).start()
        children.append(feedback)
        feedback.wait_healthy(f"http://127.0.0.1:{fb_port}/healthz", 60)
        controller = Child(
            "rollout",
            python_module("onlinerl_rollout", "--interval", "0.2", "--port", str(ctl_port)),
            tmp / "rollout.log",
            env=env,
        ).start()
        children.append(controller)
        controller.wait_healthy(f"http://127.0.0.1:{ctl_port}/healthz", 30)
        paths = {v: write_full_checkpoint(tiny_model_path, tmp / "ckpt", v) for v in (1, 2)}
        yield Stack(
            r,
            RolloutStore(r, Keys(JOB)),
            f"http://127.0.0.1:{gw_port}",
            f"http://127.0.0.1:{fb_port}",
            f"http://127.0.0.1:{rl_port}",
            f"http://127.0.0.1:{ctl_port}",
            user_keys,
            paths,
        )
    finally:
        r.close()
        for child in reversed(children):
            child.stop(timeout=5)
        valkey.stop()


@dataclass
class ScriptedUsers:
    """USERS editors, one API key each, served by CLIENTS concurrent streams; accept by the served version."""

    stack: Stack
    rng: random.Random = field(default_factory=lambda: random.Random(11))
    events: int = 0  # feedback uploads acknowledged
    requests: int = 0
    arms: dict[tuple[int, str], int] = field(default_factory=dict)  # (version, arm header) -> requests
    failures: list[str] = field(default_factory=list)
    marks: dict[str, int] = field(default_factory=dict)  # name -> events when the monitor saw it happen

    def client(self, i: int) -> ContinueClient:
        return ContinueClient(
            f"{self.stack.gateway_url}/v1", f"{self.stack.feedback_url}/api/training/submit",
            self.stack.user_keys[i % USERS], TENANT, "Qwen2.5-Coder-1.5B", QWEN, max_tokens=8, unique_id=f"editor-{i}",
        )  # fmt: skip

    async def one(self, http: httpx.AsyncClient, client: ContinueClient, n: int) -> None:
        prefix, suffix = CODE[n % len(CODE)]
        prompt = QWEN.render(prefix, suffix)
        res = await client.complete(http, prompt)
        self.requests += 1
        if res.failed or res.version is None:
            self.failures.append(f"{res.status} {res.error}")
            return
        self.arms[(res.version, res.arm)] = self.arms.get((res.version, res.arm), 0) + 1
        shown = res.text.rstrip()
        if not shown.strip():
            return  # Continue shows nothing, so it uploads nothing
        accepted = self.rng.random() < ACCEPT[res.version]
        body = client.outcome(
            prompt=prompt, prefix=prefix, suffix=suffix, filepath="app.py", shown=shown, accepted=accepted,
            latency_ms=res.latency_ms,
        )  # fmt: skip
        status, reply = await client.post_outcome(http, body)
        if status != 200:
            self.failures.append(f"upload {status} {reply}")
            return
        self.events += 1

    def run(self, steps: list[tuple[str, Callable[[], bool], Callable[[], None] | None]], timeout: float) -> None:
        """CLIENTS streams run without a pause while the monitor walks ``steps``: (name, condition, action after).
        ``marks[name]`` = feedback events acknowledged when the condition was first seen true."""
        users = [self.client(i) for i in range(USERS)]

        async def worker(http: httpx.AsyncClient, w: int, stop: asyncio.Event) -> None:
            n = w
            while not stop.is_set():
                await self.one(http, users[n % USERS], n)
                n += CLIENTS

        async def monitor(stop: asyncio.Event) -> None:
            deadline = time.monotonic() + timeout
            try:
                for name, cond, action in steps:
                    while not await asyncio.to_thread(cond):
                        assert time.monotonic() < deadline, f"step {name!r} not reached; marks {self.marks}"
                        await asyncio.sleep(0.1)
                    self.marks[name] = self.events
                    if action is not None:
                        await asyncio.to_thread(action)
            finally:
                stop.set()

        async def main() -> None:
            stop = asyncio.Event()
            async with httpx.AsyncClient(timeout=120) as http:
                workers = [asyncio.create_task(worker(http, w, stop)) for w in range(CLIENTS)]
                try:
                    await monitor(stop)
                finally:
                    await asyncio.gather(*workers)

        asyncio.run(main())


def last(stack: Stack, kind: str, version: int) -> DecisionRecord:
    recs = [d for _, d in stack.store.decisions(100) if d.decision == kind and d.version == version]
    assert recs, f"no {kind} decision on v{version}"
    return recs[-1]


def state_of(stack: Stack, version: int) -> str | None:
    s = stack.store.state(version)
    return s.state if s else None


def test_bluegreen_keeps_better_switches_back_worse_under_8_streaming_clients(stack: Stack) -> None:
    users = ScriptedUsers(stack)

    def publish(version: int) -> None:
        announce(stack.redis, stack.paths[version], version)

    def decided(version: int) -> bool:
        return state_of(stack, version) not in (None, "canary")

    def switched_or_decided(version: int) -> bool:  # a fast verdict may come before the monitor's next look
        return decided(version) or (stack.table().candidate == version and stack.holding() == version)

    t0 = time.monotonic()
    steps = [
        ("v0 baseline", lambda: stack.store.arm_stats(0, STABLE).shown >= MIN_SAMPLES, lambda: publish(1)),
        ("v1 switched", lambda: switched_or_decided(1), None),
        ("v1 decided", lambda: decided(1), None),
        ("v1 baseline", lambda: stack.store.arm_stats(1, STABLE).shown >= 1, lambda: publish(2)),
        ("v2 switched", lambda: switched_or_decided(2), None),
        ("v2 decided", lambda: decided(2), None),
        ("v1 back", lambda: stack.holding() == 1, None),
        ("v1 serves again", lambda: users.events > users.marks["v1 back"] + CLIENTS, None),
    ]
    users.run(steps, timeout=240)
    elapsed = time.monotonic() - t0
    assert not users.failures, f"{len(users.failures)} of {users.requests} requests failed: {users.failures[:5]}"

    # v1: gate, switch (everyone, arm candidate), watch against v0's snapshot, kept
    kept = last(stack, "promote", 1)
    gate1 = last(stack, "gate_pass", 1)
    assert gate1.figures["canary_share"] == 1.0 and gate1.at <= kept.at
    assert state_of(stack, 1) == "promoted"
    figs1 = kept.figures
    assert figs1["candidate"]["accept_rate"] > figs1["stable"]["accept_rate"]
    assert figs1["stable"]["shown"] >= MIN_SAMPLES and figs1["guardrail_breaches"] == []
    assert users.arms.get((1, CANDIDATE), 0) > 0 and users.arms.get((0, STABLE), 0) > 0

    # v2: gate, switch, live regression -> automatic switch back to v1, which stays stable
    back = last(stack, "rollback", 2)
    assert state_of(stack, 2) == "rolled_back"
    t = stack.table()
    assert (t.stable, t.candidate, t.canary_share) == (1, None, 0.0)
    assert back.figures["candidate"]["accept_rate"] < back.figures["stable"]["accept_rate"]
    assert users.arms.get((2, CANDIDATE), 0) > 0 and users.arms.get((1, STABLE), 0) > 0
    assert stack.holding() == 1
    assert not {arm for (_, arm) in users.arms} - {STABLE, CANDIDATE}
    assert (2, STABLE) not in users.arms, "v2's requests until the switch back stay labelled candidate"
    metrics = httpx.get(f"{stack.controller_url}/metrics", timeout=5).text
    assert 'onlinerl_rollout_gate_figure{arm="candidate",figure="suggestion_rate",version="2"}' in metrics
    assert 'onlinerl_rollout_decisions_total{decision="rollback"} 1.0' in metrics

    # the verdict and its figures are where a person looks: `onlinerl status`
    text = render(collect(stack.redis, JOB))
    assert "last verdict: rollback v2 at" in text and back.reason[:40] in text

    # Feedback events each verdict rested on: every upload is one shown suggestion, so the candidate arm's `shown` in
    # the decision's figures is exactly the number of events on the candidate since the switch.
    v1_events, v2_events = figs1["candidate"]["shown"], back.figures["candidate"]["shown"]
    # (+ CLIENTS: uploads the service had counted whose replies had not reached their client at the monitor's mark)
    assert MIN_SAMPLES <= v1_events <= users.marks["v1 decided"] - users.marks["v0 baseline"] + CLIENTS
    assert MIN_SAMPLES <= v2_events <= users.marks["v2 decided"] - users.marks["v1 baseline"] + CLIENTS
    print(
        f"\n{users.requests} requests from {CLIENTS} streaming clients, 0 failed, {elapsed:.0f}s; feedback events per "
        f"decision (switch -> verdict): keep v1 {v1_events} (look {figs1['look']}, vs v0's snapshot of "
        f"{figs1['stable']['shown']} shown), switch back v2 {v2_events} (look {back.figures['look']}, vs v1's snapshot "
        f"of {back.figures['stable']['shown']} shown); reasons: {kept.reason!r}, {back.reason!r}; "
        f"arms {sorted(users.arms.items())}"
    )
