"""Safe rollout end to end with no simulator writing statistics: every counter comes from the real components.

Real valkey, real vLLM on CPU (tiny random model, LoRA adapters), the real gateway, reloader and feedback service,
and the real controller process (``python -m onlinerl_rollout``). v0 (the base model) is stable. A scripted user
population (one API key per user, since the gateway routes by key) sends Continue's exact streaming request and
upload; each user accepts by the version the gateway says served it (``X-OnlineRL-Policy-Version``): v0 20 %, v1
70 %, v2 2 %. The better v1 must be promoted, the worse v2 rolled back, each after a counted number of feedback events.

The canary test runs the controller with the eval gate off (``rollout.gate.enabled: false``): the gate would rightly
stop v2 before any user saw it, and that test is about the canary on live traffic. The second test restarts the
controller with the gate on and the scripted user's judgement as its evaluator (tests/rollout/evaluators.py:
``scripted_user``, eval requests pinned through the real gateway): a worse v3 fails the gate, a better v4 passes.
The third shows the accepted-characters guardrail live: a v5 whose suggestions users see shorter and accept more
often, yet keep fewer characters of, is rolled back, never promoted. The last is a lone developer (issue 36): one key
alone, under the local stack's rollout settings, is served the trained v6 within minutes of its gate passing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import redis

from onlinerl.arms import CANDIDATE, EVAL, STABLE
from onlinerl.auth import write_keys_file
from onlinerl.fim import get_template
from onlinerl.keys import Keys
from onlinerl.loop.continue_client import ContinueClient
from onlinerl.procs import Child, python_module, wait_for
from onlinerl.rollout import manual
from onlinerl.rollout.records import DecisionRecord
from onlinerl.rollout.store import RolloutStore
from onlinerl.schemas import PolicyTable
from onlinerl.valkey import EmbeddedValkey, free_port
from onlinerl_serving.routing import user_hash, user_point
from tests.engines import SharedEngine, released
from tests.serving.conftest import start_gateway, start_reloader, write_config
from tests.serving.lora_helpers import publish_lora

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
JOB = "rollout-e2e"  # this module's own job on the shared engine (adapters rollout-e2e-v1, ...)

USERS = 24
TENANT = "acme"
# A lone developer's tenant: one key, alone in it (as `onlinerl up`'s demo tenant has one user key), so the feedback
# service's anomaly test has no other users to hold it against; in acme, next to the scripted users, its accept rate
# would be an outlier and quarantined (as it should be there).
SOLO_TENANT = "solo"
SOLO_KEY = next(k for k in (f"sk-solo-{i}-0123456789" for i in range(100)) if user_point(user_hash(k)) >= 0.5)
ACCEPT = {0: 0.20, 1: 0.70, 2: 0.02, 3: 0.02, 4: 0.90}
EVAL_KEY = "sk-eval-gate-0123456789"
MIN_SAMPLES = 24
QWEN = get_template("qwen")
CODE = [
    ("def add(a, b):\n    return ", "\n\nprint(add(1, 2))\n"),
    ("import os\npath = os.path.", "\n"),
    ("for i in range(", "):\n    pass\n"),
    ("class A:\n    def __init__(self):\n        self.", "\n"),
    ("values = [1, 2, 3]\ntotal = sum(", ")\n"),
]


@dataclass
class Loop:
    redis: redis.Redis
    keys: Keys
    store: RolloutStore
    gateway_url: str
    feedback_url: str
    user_keys: list[str]
    ckpt_root: Path
    base_model: Path
    logs: Path
    env: dict[str, str]
    controller: Child
    controller_port: int

    def start_controller(self, **extra_env: str) -> None:
        """(Re)start ``python -m onlinerl_rollout`` with ``extra_env`` on top of the job config."""
        if self.controller.alive():
            assert self.controller.stop(timeout=10) == 0
        self.controller = Child(
            "rollout",
            python_module("onlinerl_rollout", "--interval", "0.2", "--port", str(self.controller_port)),
            self.logs / "rollout.log",
            env={**self.env, **extra_env},
        ).start()
        self.controller.wait_healthy(f"http://127.0.0.1:{self.controller_port}/healthz", 30)


@pytest.fixture(scope="module")
def loop(tmp_path_factory: pytest.TempPathFactory, tiny_lora_engine: SharedEngine) -> Iterator[Loop]:
    tmp = tmp_path_factory.mktemp("rollout-e2e")
    user_keys = [f"sk-user-{i:02d}-0123456789" for i in range(USERS)]
    keys_file = write_keys_file(
        tmp / "keys.yaml", {TENANT: [*user_keys, {"key": EVAL_KEY, "role": "eval"}], SOLO_TENANT: [SOLO_KEY]}
    )
    valkey = EmbeddedValkey(tmp / "valkey").start()
    gw_port, rl_port, fb_port, ctl_port = (free_port() for _ in range(4))
    sections = dict(
        job=JOB,
        redis={"url": valkey.url},
        auth={"apiKeysFile": str(keys_file)},
        model={"path": str(tiny_lora_engine.model_path), "maxModelLen": 2048, "fimTemplate": "qwen"},
        storage={"checkpointDir": str(tmp / "ckpt")},
        serving={"host": "127.0.0.1", "port": gw_port, "engineUrl": tiny_lora_engine.url},
        feedback={"host": "127.0.0.1", "port": fb_port},
        rollout={
            "strategy": "canary",
            "canaryShare": 0.5,
            "minSamples": MIN_SAMPLES,
            "minDwellSeconds": 0,
            "gate": {"enabled": False},
        },
    )
    cfg_path = write_config(tmp / "config.yaml", **sections)
    env = {"ONLINERL_CONFIG": str(cfg_path), "OMP_NUM_THREADS": "1"}
    children: list[Child] = []
    r = redis.Redis.from_url(valkey.url)
    with released(tiny_lora_engine, JOB):
        try:
            children.append(start_gateway(cfg_path, tmp / "gateway.log", gw_port).child)
            children.append(start_reloader(cfg_path, tmp / "reloader.log", rl_port))
            feedback = Child("feedback", python_module("onlinerl_feedback"), tmp / "feedback.log", env=env).start()
            children.append(feedback)
            feedback.wait_healthy(f"http://127.0.0.1:{fb_port}/healthz", 60)
            loop = Loop(
                r,
                Keys(JOB),
                RolloutStore(r, Keys(JOB)),
                f"http://127.0.0.1:{gw_port}",
                f"http://127.0.0.1:{fb_port}",
                user_keys,
                tmp / "ckpt",
                tiny_lora_engine.model_path,
                tmp,
                env,
                Child("rollout", [], tmp / "rollout.log"),
                ctl_port,
            )
            loop.start_controller()
            yield loop
        finally:
            r.close()
            if "loop" in locals() and loop.controller.alive():
                loop.controller.stop(timeout=5)
            for child in reversed(children):
                child.stop(timeout=5)
            valkey.stop()


@dataclass
class ScriptedUsers:
    """USERS editors, one API key each, accepting by the served version (seeded: reproducible)."""

    loop: Loop
    rng: random.Random = field(default_factory=lambda: random.Random(7))
    events: int = 0  # feedback uploads acknowledged so far
    arms: dict[tuple[int, str], int] = field(default_factory=dict)  # (version, arm header) -> requests
    failed: int = 0
    accept: dict[int, float] = field(default_factory=lambda: dict(ACCEPT))  # version -> P(accept)
    # version -> share of each suggestion's characters the editor displays (Continue cuts displays: a prefix joins)
    display: dict[int, float] = field(default_factory=dict)
    tenant: str = TENANT  # the users' project (every key of loop.user_keys is in it)

    def clients(self) -> list[ContinueClient]:
        return [
            ContinueClient(
                f"{self.loop.gateway_url}/v1",
                f"{self.loop.feedback_url}/api/training/submit",
                key,
                self.tenant,
                "Qwen2.5-Coder-1.5B",
                QWEN,
                max_tokens=8,
                unique_id=f"editor-{i}",
            )
            for i, key in enumerate(self.loop.user_keys)
        ]

    async def one(self, http: httpx.AsyncClient, client: ContinueClient, n: int) -> None:
        prefix, suffix = CODE[n % len(CODE)]
        prompt = QWEN.render(prefix, suffix)
        res = await client.complete(http, prompt)
        if res.failed or res.version is None:
            self.failed += 1
            return
        self.arms[(res.version, res.arm)] = self.arms.get((res.version, res.arm), 0) + 1
        shown = res.text.rstrip()
        if not shown.strip():
            return  # Continue shows nothing, so it uploads nothing
        if res.version in self.display:  # keep the leading whitespace and a share of the rest: still a prefix
            lead = len(shown) - len(shown.lstrip())
            shown = shown[: lead + max(1, round((len(shown) - lead) * self.display[res.version]))]
        accepted = self.rng.random() < self.accept[res.version]
        body = client.outcome(
            prompt=prompt, prefix=prefix, suffix=suffix, filepath="app.py", shown=shown, accepted=accepted,
            latency_ms=res.latency_ms,
        )  # fmt: skip
        status, reply = await client.post_outcome(http, body)
        assert status == 200, reply
        self.events += 1

    def drive_until(self, done, timeout: float = 300.0) -> int:
        """Rounds of one request (and upload) per user until ``done()``; returns the feedback events it took."""
        start = self.events
        clients = self.clients()

        sem = asyncio.Semaphore(4)

        async def bounded(http: httpx.AsyncClient, c: ContinueClient, i: int) -> None:
            async with sem:
                await self.one(http, c, i)

        async def run() -> None:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            n = 0
            async with httpx.AsyncClient(timeout=60) as http:
                while not done():
                    assert loop.time() < deadline, f"no decision after {self.events - start} feedback events"
                    await asyncio.gather(*(bounded(http, c, n + i) for i, c in enumerate(clients)))
                    n += 1

        asyncio.run(run())
        return self.events - start


def table(loop: Loop) -> PolicyTable:
    return loop.store.policy()


def last_decision(loop: Loop, kind: str, version: int) -> DecisionRecord:
    recs = [d for _, d in loop.store.decisions(50) if d.decision == kind and d.version == version]
    assert recs, f"no {kind} decision on v{version}"
    return recs[-1]


def scripted_gate(loop: Loop, samples: int, accept: dict[int, float]) -> dict[str, str]:
    """The controller's environment for the eval gate on, ``samples`` eval requests per version, judged by the scripted
    user (tests/rollout/evaluators.py: ``scripted_user``, with the rates in ``accept``) through the real gateway."""
    return {
        "ONLINERL__ROLLOUT__GATE__ENABLED": "true",
        "ONLINERL__ROLLOUT__GATE__EVAL_SAMPLES": str(samples),
        # The scripted user judges acceptance only; how long each version's text is comes from the tiny random model
        # (v4's 8 tokens ran ~40% shorter than v1's, so at the default 0.75 the accepted-chars guardrail failed a
        # candidate the user prefers). 0.3 still fails v3 on it (asserted below) and leaves v4's verdict to the user.
        "ONLINERL__ROLLOUT__GATE__MIN_ACCEPTED_CHARS_RATIO": "0.3",
        "ONLINERL_ROLLOUT_EVALUATOR": "tests.rollout.evaluators:scripted_user",
        "ONLINERL_TEST_GATEWAY_URL": loop.gateway_url,
        "ONLINERL_TEST_EVAL_KEY": EVAL_KEY,
        "ONLINERL_TEST_ACCEPT": json.dumps(accept),
    }


def settle_on_v1(loop: Loop) -> None:
    """Bring the module to where the canary test leaves it: stable v1, no candidate, no manual hold. A test that runs
    alone gets there the same way, through the product: v1 published, made the candidate by the controller and
    promoted on the scripted users' live feedback; a canary still running (the gate test's v4) is ended by a manual
    rollback and the hold it leaves released."""
    if table(loop).stable == 0 and loop.store.state(1) is None:
        users = ScriptedUsers(loop)
        publish_lora(loop.redis, JOB, loop.base_model, loop.ckpt_root, 1)
        wait_for(lambda: table(loop).candidate == 1, timeout=120, what="v1 to become the candidate")
        users.drive_until(lambda: table(loop).stable == 1)
    if table(loop).candidate is not None:
        manual.rollback(loop.store, actor="test")  # ends the canary; stable stays
    if table(loop).hold is not None or table(loop).paused:
        manual.set_paused(loop.store, False, actor="test")  # releases the manual hold
    assert (table(loop).stable, table(loop).candidate, table(loop).hold) == (1, None, None)


def test_better_candidate_promoted_worse_rolled_back(loop: Loop) -> None:
    users = ScriptedUsers(loop)
    # v0 stable: its traffic is arm "stable" end to end (it was "base", which the controller never read)
    users.drive_until(lambda: users.events >= USERS)
    assert {arm for (v, arm) in users.arms} == {STABLE}
    assert loop.redis.hget(loop.keys.stats(0, STABLE), "shown") is not None
    assert not loop.redis.exists(loop.keys.stats(0, "base"))

    # v1 published -> loaded -> candidate with half the users -> promoted on live feedback
    publish_lora(loop.redis, JOB, loop.base_model, loop.ckpt_root, 1)
    wait_for(lambda: table(loop).candidate == 1, timeout=120, what="v1 to become the candidate")
    assert table(loop).canary_share == 0.5
    v1_events = users.drive_until(lambda: table(loop).stable == 1)
    promote = last_decision(loop, "promote", 1)
    assert (users.arms.get((1, CANDIDATE), 0), users.arms.get((0, STABLE), 0)) > (0, 0)
    figs = promote.figures
    assert figs["candidate"]["accept_rate"] > figs["stable"]["accept_rate"]
    assert figs["samples"] >= MIN_SAMPLES and figs["guardrail_breaches"] == []
    assert loop.store.state(1).state == "promoted"

    # v2 published -> candidate against stable v1 -> rolled back; v1 stays stable
    publish_lora(loop.redis, JOB, loop.base_model, loop.ckpt_root, 2)
    wait_for(lambda: table(loop).candidate == 2, timeout=120, what="v2 to become the candidate")
    v2_events = users.drive_until(lambda: loop.store.state(2) is not None and loop.store.state(2).state != "canary")
    rollback = last_decision(loop, "rollback", 2)
    assert loop.store.state(2).state == "rolled_back"
    assert (table(loop).stable, table(loop).candidate) == (1, None)
    assert rollback.figures["candidate"]["accept_rate"] < rollback.figures["stable"]["accept_rate"]
    assert users.failed == 0
    print(
        f"\nfeedback events per decision: promote v1 {v1_events} (look {figs['look']}, {figs['samples']} shown in the "
        f"smaller arm), rollback v2 {v2_events} (look {rollback.figures['look']}, {rollback.figures['samples']} "
        f"shown); reasons: {promote.reason!r}, {rollback.reason!r}"
    )


def test_gate_on_judges_through_the_real_gateway(loop: Loop) -> None:
    """The controller with the gate on: the scripted user's judgement, on eval requests pinned to each version
    through the real gateway (arm ``eval``, never counted in the canary's arms), decides the gate."""
    settle_on_v1(loop)  # where the canary test leaves it (run alone: this test gets there itself)
    loop.start_controller(**scripted_gate(loop, 24, ACCEPT))
    eval_served_before = int(loop.redis.hget(loop.keys.stats(1, EVAL), "served") or 0)
    publish_lora(loop.redis, JOB, loop.base_model, loop.ckpt_root, 3)
    wait_for(lambda: loop.store.state(3) is not None, timeout=120, what="the gate's verdict on v3")
    fail = last_decision(loop, "gate_fail", 3)
    assert loop.store.state(3).state == "gate_failed" and table(loop).candidate is None
    assert fail.figures["candidate"]["requests"] == fail.figures["stable"]["requests"] == 24
    assert "accept rate" in fail.reason and "guardrail: accepted chars per 100 requests" in fail.reason
    assert int(loop.redis.hget(loop.keys.stats(1, EVAL), "served") or 0) >= eval_served_before + 24

    publish_lora(loop.redis, JOB, loop.base_model, loop.ckpt_root, 4)
    wait_for(lambda: table(loop).candidate == 4, timeout=120, what="v4 to pass the gate")
    passed = last_decision(loop, "gate_pass", 4)
    assert passed.figures["candidate"]["accept_rate"] > passed.figures["stable"]["accept_rate"]
    assert passed.figures["canary_share"] == 0.5
    print(f"\ngate: v3 failed ({fail.reason}); v4 passed ({passed.reason})")


def test_shorter_candidate_accepted_more_is_rolled_back_on_accepted_characters(loop: Loop) -> None:
    """Reward hacking through the real gateway, feedback service and controller (the failure Cursor names first):
    v5's suggestions reach the user at a third of their length and are accepted 95 % of the time against stable v1's
    70 %. It wins on accept rate and loses on what users keep, accepted characters per 100 requests: the canary
    rolls it back with that reason and never promotes it. The gate is off, as in the canary test above."""
    loop.start_controller()  # the module's configuration: gate off
    settle_on_v1(loop)  # ends the gate test's v4 canary (run alone: promotes v1 first)
    users = ScriptedUsers(loop, accept={**ACCEPT, 5: 0.95}, display={5: 1 / 3})

    publish_lora(loop.redis, JOB, loop.base_model, loop.ckpt_root, 5)
    wait_for(lambda: table(loop).candidate == 5, timeout=120, what="v5 to become the candidate")
    events = users.drive_until(lambda: loop.store.state(5) is not None and loop.store.state(5).state != "canary")
    assert loop.store.state(5).state == "rolled_back"
    assert [d.decision for _, d in loop.store.decisions(50) if d.version == 5 and d.decision == "promote"] == []
    rollback = last_decision(loop, "rollback", 5)
    assert "accepted chars per 100 requests" in rollback.reason
    cand, stable = rollback.figures["candidate"], rollback.figures["stable"]
    assert cand["accept_rate"] > stable["accept_rate"]
    assert cand["accepted_chars_per_100"] < 0.9 * stable["accepted_chars_per_100"]
    assert (table(loop).stable, table(loop).candidate) == (1, None) and users.failed == 0
    print(f"\nshorter v5 rolled back after {events} feedback events: {rollback.reason}")


def test_a_lone_key_is_served_the_trained_version_within_minutes(loop: Loop) -> None:
    """A lone developer (issue 36): one key, on the stable arm by its hash, is the whole traffic. The controller runs
    with the local stack's rollout settings (rollout.fewUsers: decide, minSamples 30, maxLooks 1, canary share 0.5,
    the gate on with 32 eval samples per version: tests/rollout/test_lone_developer.py computes them from the
    product's functions), except minDwellSeconds 0 (the dwell is a clock wait, which the simulated-clock test there
    spends in full) and the accepted-characters floors at 0.3 (the tiny random model's lengths, as in the gate test).
    Through the real gateway, feedback and controller processes: the canary splits by request after
    30 requests from one user, the key is served the candidate, its outcomes count in the arm that served them, the
    pooled verdict promotes v6, and `onlinerl status` says what the canary waits for meanwhile."""
    from onlinerl.loop.status import collect, render

    settle_on_v1(loop)
    accept = {**ACCEPT, 6: 0.9}
    loop.start_controller(
        ONLINERL__ROLLOUT__FEW_USERS="decide",
        ONLINERL__ROLLOUT__MIN_SAMPLES="30",
        ONLINERL__ROLLOUT__MAX_LOOKS="1",
        ONLINERL__ROLLOUT__CANARY_SHARE="0.5",
        # the live floor as the gate's (scripted_gate): the tiny random model's lengths are not the user's preference
        ONLINERL__ROLLOUT__GUARDRAILS__MIN_ACCEPTED_CHARS_RATIO="0.3",
        **scripted_gate(loop, 32, accept),
    )
    try:
        # one key, alone in its tenant, on the stable arm by its hash (the measured case: served v0 for ever)
        users = ScriptedUsers(dataclasses.replace(loop, user_keys=[SOLO_KEY]), accept=accept, tenant=SOLO_TENANT)
        publish_lora(loop.redis, JOB, loop.base_model, loop.ckpt_root, 6)
        wait_for(lambda: table(loop).candidate == 6, timeout=180, what="v6 to pass the gate")
        t0 = time.monotonic()
        said: list[str] = []
        first_v6: list[float] = []

        def done() -> bool:
            said.append(render(collect(loop.redis, JOB)))
            if not first_v6 and users.arms.get((6, CANDIDATE), 0) > 0:
                first_v6.append(time.monotonic() - t0)
            return table(loop).stable == 6

        try:
            events = users.drive_until(done, timeout=240)
        except AssertionError as exc:  # say what the canary waited for, and what the key was served
            raise AssertionError(f"{exc}; served {users.arms}; {said[-1] if said else 'no status'}") from exc
        promoted_after = time.monotonic() - t0
    finally:
        loop.start_controller()  # the module's configuration
    assert users.failed == 0
    assert any(
        "1 user(s) in this canary, fewer than the 4 a look needs" in s and "splits by request" in s for s in said
    )
    assert any("split by request, judged on pooled counters" in s and "of requests" in s for s in said)
    decisions = [d for _, d in loop.store.decisions(50) if d.version == 6]
    assert decisions[0].decision == "gate_pass" and decisions[-1].decision == "promote"
    assert any(d.decision == "hold" and "came from 1 user(s)" in d.reason for d in decisions)
    assert "few-user canary (1 user(s), fewer than 4)" in decisions[-1].reason
    # the one key was served both arms, and each outcome counted in the arm that served it
    assert users.arms.get((6, CANDIDATE), 0) > 0 and users.arms.get((1, STABLE), 0) > 0
    [(_, cand_user)] = loop.store.arm_users(6, CANDIDATE, 6).items()  # one user in each arm's ledger: the key
    [(_, stable_user)] = loop.store.arm_users(1, STABLE, 6).items()
    assert cand_user.served == loop.store.arm_stats(6, CANDIDATE).served == users.arms[(6, CANDIDATE)]
    assert stable_user.shown > 0 and cand_user.shown > 0
    assert table(loop).split == "key" and first_v6
    print(
        f"\nlone key: first served v6 {first_v6[0]:.0f} s after its gate passed, promoted after {promoted_after:.0f} s "
        f"({events} feedback events): {decisions[-1].reason}"
    )
