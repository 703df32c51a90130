"""Blue/green end to end in full-weight mode, with no simulator writing statistics: every counter comes from the real
components.

Real valkey, real vLLM on CPU holding one version at a time (tiny random model, full weights, dev mode), the real
gateway, reloader and feedback service, and the real controller process (``python -m onlinerl_rollout``) under the
strategy full-weight mode defaults to (``bluegreen``: the config does not name one). v0 (the base model) is stable.
A scripted user population (one API key per user) runs as 8 concurrent streaming clients throughout, each sending
Continue's exact streaming request and upload and accepting by the version the gateway says served it
(``X-OnlineRL-Policy-Version``): v0 30 %, v1 75 %, v2 3 %, v3 3 %.

The eval gate is ON (the default) with the scripted user's judgement on eval requests pinned through the real gateway
(``tests.rollout.evaluators:scripted_user``, an eval-role key): stable first while it serves, then the candidate in a
*preview* (the reloader swaps vLLM's weights to it, the gateway holds user requests and lets only the eval requests
through, recorded as arm ``eval``). Eval acceptance: v0 30 %, v1 75 %, v2 3 %, v3 100 %.

v1 passes the gate; the previewed weights stay and serve everyone (arm ``candidate``), the watch compares its live
figures with v0's snapshot and keeps it. v2 fails the gate: the reloader swaps v1 back and no user is ever served by
v2. v3 passes the gate but users reject it: it is switched back to v1 automatically on its live regression. Zero
requests fail through the previews, the switch and the switches back, and the test prints the feedback events each
decision took.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import redis

from onlinerl.arms import CANDIDATE, EVAL, STABLE
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
from tests.engines import SharedEngine, back_to_the_base, released
from tests.serving.conftest import JOB, start_gateway, start_reloader, write_config
from tests.serving.test_full_weights import announce, write_full_checkpoint

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

USERS = 24
CLIENTS = 8
TENANT = "acme"
ACCEPT = {0: 0.30, 1: 0.75, 2: 0.03, 3: 0.03}
EVAL_ACCEPT = {0: 0.30, 1: 0.75, 2: 0.03, 3: 1.0}  # the gate's scripted judgement: v3 looks good offline only
EVAL_KEY = "sk-eval-gate-0123456789"
# The gate on, with its length guardrails opened wide: each perturbed copy of the tiny random model writes text of an
# arbitrary length (v1 about 7x v0's), which says nothing about quality. Here the scripted accept rate decides; the
# guardrails' own bars are tested in tests/rollout/test_gate.py and test_guardrails_live.py.
GATE = {"evalSamples": 16, "maxLengthRatio": 100.0, "minLengthRatio": 0.01, "minAcceptedCharsRatio": 0.05}
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
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_full_engine: SharedEngine) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("bluegreen-e2e")
    user_keys = [f"sk-user-{i:02d}-0123456789" for i in range(USERS)]
    keys_file = write_keys_file(tmp / "keys.yaml", {TENANT: [*user_keys, {"key": EVAL_KEY, "role": "eval"}]})
    valkey = EmbeddedValkey(tmp / "valkey").start()
    gw_port, rl_port, fb_port, ctl_port = (free_port() for _ in range(4))
    tiny_model_path = tiny_full_engine.model_path
    sections = dict(
        redis={"url": valkey.url},
        auth={"apiKeysFile": str(keys_file)},
        model={"path": str(tiny_model_path), "maxModelLen": 1024, "fimTemplate": "qwen"},
        trainer={"weights": "full"},
        storage={"checkpointDir": str(tmp / "ckpt")},
        serving={
            "host": "127.0.0.1",
            "port": gw_port,
            "engineUrl": tiny_full_engine.url,
            "weightsMode": "full",
            "drainTimeoutSeconds": 30,
        },
        feedback={"host": "127.0.0.1", "port": fb_port},
        rollout={"minSamples": MIN_SAMPLES, "minDwellSeconds": 0, "gate": GATE},  # no strategy named
    )
    cfg_path = write_config(tmp / "config.yaml", **sections)
    cfg = from_mapping({"job": JOB, **sections})
    assert cfg.rollout.strategy == "bluegreen", "full-weight mode defaults to blue/green"
    assert cfg.rollout.gate.enabled, "the gate is on by default, in full-weight mode too"
    env = {
        "ONLINERL_CONFIG": str(cfg_path),
        "OMP_NUM_THREADS": "1",
        "ONLINERL_ROLLOUT_EVALUATOR": "tests.rollout.evaluators:scripted_user",
        "ONLINERL_TEST_GATEWAY_URL": f"http://127.0.0.1:{gw_port}",
        "ONLINERL_TEST_EVAL_KEY": EVAL_KEY,
        "ONLINERL_TEST_ACCEPT": json.dumps(EVAL_ACCEPT),
    }
    children: list[Child] = []
    r = redis.Redis.from_url(valkey.url)
    with released(tiny_full_engine, JOB):
        try:
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
            paths = {v: write_full_checkpoint(tiny_model_path, tmp / "ckpt", v) for v in (1, 2, 3)}
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
            back_to_the_base(r, JOB, f"http://127.0.0.1:{rl_port}")
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

    def run(
        self,
        steps: list[tuple[str, Callable[[], bool], Callable[[], None] | None]],
        timeout: float,
        observe: Callable[[], None] | None = None,
    ) -> None:
        """CLIENTS streams run without a pause while the monitor walks ``steps``: (name, condition, action after).
        ``marks[name]`` = feedback events acknowledged when the condition was first seen true. ``observe`` runs at
        each of the monitor's looks."""
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
                        if observe is not None:
                            await asyncio.to_thread(observe)
                        await asyncio.sleep(0.05)
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


def gateway_counts(stack: Stack, metric: str) -> dict[tuple[int, str], float]:
    """``onlinerl_serving_<metric>`` per (version, arm), summed over the other labels."""
    out: dict[tuple[int, str], float] = {}
    for line in httpx.get(f"{stack.gateway_url}/metrics", timeout=5).text.splitlines():
        if not line.startswith(f"onlinerl_serving_{metric}{{"):
            continue
        labels = dict(kv.split("=", 1) for kv in line[line.index("{") + 1 : line.index("}")].split(","))
        if labels.get("code", '"200"') != '"200"':
            continue
        key = (int(labels["version"].strip('"')), labels["arm"].strip('"'))
        out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def test_gate_previews_then_keeps_better_refuses_worse_switches_back_regression_under_8_streaming_clients(
    stack: Stack,
) -> None:
    users = ScriptedUsers(stack)
    previews: dict[int, str] = {}  # version -> the `onlinerl status` line seen while it was previewed

    def publish(version: int) -> None:
        announce(stack.redis, stack.paths[version], version)

    def decided(version: int) -> bool:
        return state_of(stack, version) not in (None, "canary")

    def switched_or_decided(version: int) -> bool:  # a fast verdict may come before the monitor's next look
        return decided(version) or (stack.table().candidate == version and stack.holding() == version)

    def watch_previews() -> None:
        t = stack.table()
        if t.preview is not None and t.preview not in previews:
            line = next((ln for ln in render(collect(stack.redis, JOB)).splitlines() if "previewing" in ln), "")
            if line:
                previews[t.preview] = line

    def back_on(version: int) -> Callable[[], bool]:
        return lambda: stack.holding() == version and stack.table().preview is None

    t0 = time.monotonic()
    steps = [
        ("v0 baseline", lambda: stack.store.arm_stats(0, STABLE).shown >= MIN_SAMPLES, lambda: publish(1)),
        ("v1 switched", lambda: switched_or_decided(1), None),
        ("v1 decided", lambda: decided(1), None),
        ("v1 baseline", lambda: stack.store.arm_stats(1, STABLE).shown >= 1, lambda: publish(2)),
        ("v2 refused", lambda: decided(2), None),
        ("v1 back after v2's preview", back_on(1), lambda: publish(3)),
        ("v3 switched", lambda: switched_or_decided(3), None),
        ("v3 decided", lambda: decided(3), None),
        ("v1 back after v3", back_on(1), None),
        ("v1 serves again", lambda: users.events > users.marks["v1 back after v3"] + CLIENTS, None),
    ]
    users.run(steps, timeout=240, observe=watch_previews)
    elapsed = time.monotonic() - t0
    assert not users.failures, f"{len(users.failures)} of {users.requests} requests failed: {users.failures[:5]}"

    # v1: gate (stable evaluated while serving, v1 in a preview), the previewed weights serve everyone, kept
    gate1, kept = last(stack, "gate_pass", 1), last(stack, "promote", 1)
    assert gate1.figures["canary_share"] == 1.0 and gate1.at <= kept.at
    assert gate1.figures["candidate"]["requests"] == gate1.figures["stable"]["requests"] == 16
    assert gate1.figures["candidate"]["accept_rate"] > gate1.figures["stable"]["accept_rate"]
    assert state_of(stack, 1) == "promoted"
    figs1 = kept.figures
    assert figs1["candidate"]["accept_rate"] > figs1["stable"]["accept_rate"]
    assert figs1["stable"]["shown"] >= MIN_SAMPLES and figs1["guardrail_breaches"] == []
    assert users.arms.get((1, CANDIDATE), 0) > 0 and users.arms.get((0, STABLE), 0) > 0

    # v2: refused by the gate in its preview; users never got it, the weights went back to v1
    refused = last(stack, "gate_fail", 2)
    assert state_of(stack, 2) == "gate_failed" and "accept rate" in refused.reason
    assert not [k for k in users.arms if k[0] == 2], f"a user was served by v2: {users.arms}"

    # v3: passes the gate, users reject it live -> automatic switch back to v1, which stays stable
    assert last(stack, "gate_pass", 3).figures["canary_share"] == 1.0
    back = last(stack, "rollback", 3)
    assert state_of(stack, 3) == "rolled_back"
    assert back.figures["candidate"]["accept_rate"] < back.figures["stable"]["accept_rate"]
    assert users.arms.get((3, CANDIDATE), 0) > 0 and users.arms.get((1, STABLE), 0) > 0
    t = stack.table()
    assert (t.stable, t.candidate, t.canary_share, t.preview) == (1, None, 0.0, None)
    assert stack.holding() == 1
    assert not {arm for (_, arm) in users.arms} - {STABLE, CANDIDATE}
    assert (3, STABLE) not in users.arms, "v3's requests until the switch back stay labelled candidate"

    # No user request was served during a preview: each version's user traffic carries the arm the table gave it
    # (a user let through a preview would be labelled stable on a version that was never stable: v2, v3), and every
    # completion the gateway recorded for a user arm is one a user got, with the same version.
    recorded = gateway_counts(stack, "rollouts_recorded_total")
    assert {k: int(n) for k, n in recorded.items() if k[1] != EVAL} == users.arms
    assert all(recorded.get((v, EVAL), 0) >= 16 for v in (1, 2, 3)), f"the previews served the eval: {recorded}"
    assert all(previews.get(v, "").startswith(f"previewing v{v}:") for v in (1, 2, 3)), previews

    metrics = httpx.get(f"{stack.controller_url}/metrics", timeout=5).text
    assert 'onlinerl_rollout_gate_figure{arm="candidate",figure="accept_rate",version="3"} 1.0' in metrics  # last gate
    assert 'onlinerl_rollout_decisions_total{decision="rollback"} 1.0' in metrics
    assert 'onlinerl_rollout_decisions_total{decision="gate_fail"} 1.0' in metrics

    # the verdict and its figures are where a person looks: `onlinerl status`
    text = render(collect(stack.redis, JOB))
    assert "last verdict: rollback v3 at" in text and back.reason[:40] in text

    # Feedback events each verdict rested on: every upload is one shown suggestion, so the candidate arm's `shown` in
    # the decision's figures is exactly the number of events on the candidate since the switch.
    v1_events, v3_events = figs1["candidate"]["shown"], back.figures["candidate"]["shown"]
    # (+ CLIENTS: uploads the service had counted whose replies had not reached their client at the monitor's mark)
    assert MIN_SAMPLES <= v1_events <= users.marks["v1 decided"] - users.marks["v0 baseline"] + CLIENTS
    assert MIN_SAMPLES <= v3_events <= users.marks["v3 decided"] - users.marks["v1 back after v2's preview"] + CLIENTS
    print(
        f"\n{users.requests} requests from {CLIENTS} streaming clients, 0 failed, {elapsed:.0f}s; feedback events per "
        f"decision (switch -> verdict): keep v1 {v1_events} (look {figs1['look']}, vs v0's snapshot of "
        f"{figs1['stable']['shown']} shown), refuse v2 at the gate (0 user events), switch back v3 {v3_events} (look "
        f"{back.figures['look']}, vs v1's snapshot of {back.figures['stable']['shown']} shown); reasons: "
        f"{kept.reason!r}, {refused.reason[:80]!r}, {back.reason!r}; arms {sorted(users.arms.items())}; "
        f"eval records {sorted((k, int(n)) for k, n in recorded.items() if k[1] == EVAL)}"
    )
