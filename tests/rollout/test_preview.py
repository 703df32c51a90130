"""The eval gate's preview in full-weight mode (vLLM holds one version): its state machine, without vLLM.

* ``preview.step`` (pure): wait -> ready, or timeout / failed, against the wall-clock deadline;
* the gateway's weights gate during a preview: only eval requests pinned to the previewed version pass, users wait
  (and get the gate's 503 reason at their own timeout, never a silent drop), and the verdict's ``serving`` lets them in;
* the reloader's target: the table's preview before its deadline, stable again past it (a dead controller cannot hold
  users), never a version it cannot load now;
* the controller on a real valkey with no reloader answering: the preview times out, is ended at once (users
  released), retried with backoff, then ``gate_fail`` with the reason; nothing is switched.

tests/rollout/test_e2e_full_weights.py runs the preview through the real gateway, reloader and vLLM.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from onlinerl.config import from_mapping
from onlinerl.keys import Keys
from onlinerl.schemas import PolicyTable
from onlinerl_rollout.controller import EvalRequest, RolloutController
from onlinerl_rollout.gate import GateInput
from onlinerl_rollout.preview import step
from onlinerl_serving.weights_gate import WeightsGate, WeightsUnknown
from tests.rollout.sim import ArmSimulator, Truth
from tests.rollout.test_bluegreen import JOB, bluegreen_cfg, ready, table
from tests.rollout.test_controller import FakeClock


# --- the controller's step (pure) -----------------------------------------------------------------------------------
def test_step_waits_for_previewing_until_the_deadline() -> None:
    assert step("ready", 10.0, 20.0) == "wait"  # asked, no reloader has swapped yet
    assert step("loading", 19.9, 20.0) == "wait"  # some replicas still switching (the aggregate says loading)
    assert step("previewing", 12.0, 20.0) == "ready"
    assert step(None, 12.0, 20.0) == "wait"
    assert step("ready", 20.0, 20.0) == "timeout"
    assert step("previewing", 20.0, 20.0) == "timeout"  # in place, but too late: the reloaders are leaving it
    assert step("failed", 12.0, 20.0) == "failed"  # vLLM cannot load it: waiting would only hold users


def test_policy_table_preview_ends_at_its_deadline() -> None:
    t = PolicyTable.from_redis(PolicyTable(stable=1, preview=2, preview_until=100.0).to_redis())
    assert (t.preview, t.preview_until) == (2, 100.0)
    assert t.previewing(99.0) == 2 and t.previewing(100.0) is None
    assert PolicyTable.from_redis({"stable": "1", "preview": "", "preview_until": "0.0"}).previewing(0.0) is None
    assert PolicyTable.from_redis({"stable": "1"}).previewing(0.0) is None  # tables written before previews


# --- the gateway's weights gate -------------------------------------------------------------------------------------
def test_weights_gate_lets_only_the_previewed_versions_eval_requests_through() -> None:
    async def main() -> None:
        gate = WeightsGate()
        gate.open(1)
        assert await gate.enter(1.0) == 1
        gate.leave()
        assert await gate.shut(1.0)  # the reloader drains before the swap
        gate.open(2, preview=True)
        assert gate.known and gate.view()["previewing"] is True  # /readyz stays ready: eval requests reach it

        user = asyncio.ensure_future(gate.enter(5.0))
        stable_eval = asyncio.ensure_future(gate.enter(5.0, forced=1))  # pinned to a version not held: waits too
        assert await gate.enter(1.0, forced=2) == 2  # the gate's eval request goes at once
        await asyncio.sleep(0.05)
        assert not user.done() and not stable_eval.done() and gate.inflight == 1
        gate.leave()

        with pytest.raises(WeightsUnknown, match="held for the eval gate's preview"):
            await gate.enter(0.05)  # a held user past its own timeout: the gateway answers 503 + Retry-After

        gate.open(2)  # the preview passed: the same weights serve everyone
        assert await asyncio.wait_for(user, 1.0) == 2
        assert await asyncio.wait_for(stable_eval, 1.0) == 2  # the gateway then answers it 409 (v1 not held)
        assert gate.view() == {"version": 2, "switching": False, "previewing": False, "inflight": 2}

    asyncio.run(main())


def test_weights_gate_releases_users_to_stable_when_the_preview_fails() -> None:
    async def main() -> None:
        gate = WeightsGate()
        gate.open(3, preview=True)
        user = asyncio.ensure_future(gate.enter(5.0))
        await asyncio.sleep(0.02)
        assert await gate.shut(1.0)  # swap back: eval requests drained
        assert not user.done()
        gate.open(1)
        assert await asyncio.wait_for(user, 1.0) == 1  # the user is served by stable, never by the previewed v3

    asyncio.run(main())


def test_weights_endpoint_rejects_a_bad_preview() -> None:
    from starlette.applications import Starlette
    from starlette.routing import Route

    from onlinerl_serving.weights_gate import weights_endpoint

    gate = WeightsGate()
    app = Starlette(routes=[Route("/w", weights_endpoint(gate, {"testclient"}), methods=["GET", "POST"])])
    from starlette.testclient import TestClient

    with TestClient(app) as c:
        bad = c.post("/w", json={"state": "previewing", "version": -1})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "version"
        bad = c.post("/w", json={"state": "previewing", "version": True})
        assert bad.status_code == 400
        bad = c.post("/w", json={"state": "preview"})
        assert bad.status_code == 400 and "previewing" in bad.json()["error"]["message"]
        ok = c.post("/w", json={"state": "previewing", "version": 4})
        assert ok.json() == {"version": 4, "switching": False, "previewing": True, "inflight": 0}


# --- the reloader's target --------------------------------------------------------------------------------------------
def test_reloader_previews_until_the_deadline_then_restores_stable() -> None:
    from onlinerl_serving.checkpoints import Announcement
    from onlinerl_serving.reloader import Reloader, Version

    cfg = from_mapping({"job": JOB, "serving": {"weightsMode": "full"}})
    rl = Reloader(cfg, None, httpx.AsyncClient(), httpx.AsyncClient())
    for v in (1, 2, 3):
        rl.versions[v] = Version(Announcement(f"{v}-0", v, f"/c/v{v}", "full", ""))
    now = time.time()
    t = PolicyTable(stable=1, preview=3, preview_until=now + 60)
    assert rl.preview_target(t, now) == 3
    assert rl.preview_target(t, now + 61) is None and rl.full_target(t) == 1  # expired: stable, users released
    assert rl.preview_target(t.model_copy(update={"pinned": 2}), now) is None  # a pin wins
    assert rl.preview_target(t.model_copy(update={"preview": 7}), now) is None  # never announced here
    # hostile: a deadline past the configured bound (180 s + 30 s of clock slack) would hold users: refused
    assert rl.preview_target(t.model_copy(update={"preview_until": now + 211}), now) is None
    assert rl.preview_target(t.model_copy(update={"preview_until": now + 209}), now) == 3
    assert rl.preview_target(t.model_copy(update={"preview_until": float("inf")}), now) is None
    rl.versions[3].next_attempt = time.monotonic() + 30  # its last load failed: backing off
    assert rl.preview_target(t, now) is None
    rl.versions[3].next_attempt, rl.versions[3].state = 0.0, "failed"
    assert rl.preview_target(t, now) is None


# --- the controller, real valkey, no reloader answering: the timeout path --------------------------------------------
def test_preview_not_in_place_times_out_releases_users_and_fails_the_gate_after_retries(redis_client) -> None:
    r, clock = redis_client, FakeClock()
    r.hset(Keys(JOB).policy, mapping=PolicyTable(stable=0).to_redis())
    ArmSimulator(r, JOB, {0: Truth(0.30)}, seed=3).serve(400)  # stable's baseline for the switch
    ready(r, 1)
    seen: list[PolicyTable] = []

    def evaluator(req: EvalRequest) -> GateInput:
        # (stable is evaluated first, while it serves: no preview yet)
        seen.append(table(r))
        req.enter_candidate()  # nobody swaps v1 in: PreviewError at the deadline
        raise AssertionError("unreachable: the preview never came")

    cfg = bluegreen_cfg(gate={"evalSamples": 8, "previewTimeoutSeconds": 0.3})
    ctl = RolloutController(r, JOB, cfg, evaluator, clock=clock, gate_attempts=2, gate_retry_seconds=5.0)
    t0 = time.monotonic()
    assert ctl.tick() == []  # attempt 1: timed out, retry later
    # the preview's own deadline (0.3 s) ended the wait: not sooner, and not the default timeout (minutes) or a hang
    assert 0.3 <= time.monotonic() - t0 < 30.0
    t = table(r)
    assert t.preview is None and t.candidate is None  # ended at once: users are not held until the deadline
    assert seen[0].preview is None  # stable was evaluated before any preview
    assert ctl.tick() == []  # backing off (the fake clock has not moved)
    clock.now += 5.0
    [rec] = ctl.tick()  # attempt 2 of 2
    assert rec.decision == "gate_fail" and rec.version == 1
    assert "previewTimeoutSeconds" in rec.reason and "not in place" in rec.reason
    t = table(r)
    assert (t.stable, t.candidate, t.preview, t.canary_share) == (0, None, None, 0.0)
    assert ctl.store.state(1).state == "gate_failed"


def test_preview_is_ended_when_the_evaluator_fails_mid_preview(redis_client) -> None:
    """A reloader that swapped v1 in is told at once to give vLLM back: the table's preview is cleared."""
    from onlinerl.dataplane import versions
    from onlinerl.schemas import PolicyVersionState

    r = redis_client
    r.hset(Keys(JOB).policy, mapping=PolicyTable(stable=0).to_redis())
    ArmSimulator(r, JOB, {0: Truth(0.30)}, seed=3).serve(400)
    ready(r, 1)

    def evaluator(req: EvalRequest) -> GateInput:
        # what a reloader writes once the gateway lets eval requests through (the e2e test has the real one)
        versions.report(r, Keys(JOB), "r-0", [PolicyVersionState(version=1, state="previewing")], ttl=3600)
        req.enter_candidate()
        assert table(r).previewing(time.time()) == 1
        raise RuntimeError("gateway went away")

    ctl = RolloutController(r, JOB, bluegreen_cfg(gate={"evalSamples": 8}), evaluator, clock=FakeClock())
    assert ctl.tick() == []
    assert table(r).preview is None and table(r).candidate is None
