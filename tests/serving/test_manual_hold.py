"""Manual decisions stick, and full-weight mode's gate, without vLLM: real valkey, the reloader's own raise script,
the gateway's own weights gate and endpoint.

The end-to-end versions (real vLLM, restarts, 8 streaming clients) are in test_full_weights.py.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
import redis.asyncio as aioredis
from starlette.applications import Starlette
from starlette.routing import Route
from starlette.testclient import TestClient

from onlinerl.config import from_mapping
from onlinerl.keys import Keys
from onlinerl.rollout import manual
from onlinerl.rollout.store import RolloutStore
from onlinerl.schemas import PolicyTable
from onlinerl_serving.reloader import Reloader
from onlinerl_serving.weights_gate import WeightsGate, WeightsUnknown, weights_endpoint
from tests.rollout.sim import publish_loaded

JOB = "hold"


def _raise(url: str, v: int, strategy: str = "direct") -> tuple[bool, dict | None]:
    """The reloader's direct raise (its real Lua), as a load of v under ``strategy`` would run it."""

    async def go() -> tuple[bool, dict | None]:
        r = aioredis.from_url(url)
        cfg = from_mapping({"job": JOB, "rollout": {"strategy": strategy}})
        async with httpx.AsyncClient() as engine:
            rl = Reloader(cfg, r, engine, engine)
            try:
                return await rl._raise_stable(v), rl.last_raise
            finally:
                await r.aclose()

    return asyncio.run(go())


def test_a_manual_rollback_holds_stable_until_resume(empty_valkey, redis_client) -> None:
    keys = Keys(JOB)
    store = RolloutStore(redis_client, keys)
    for v in (1, 2, 3, 4):
        publish_loaded(redis_client, JOB, v)
    assert _raise(empty_valkey.url, 1)[0] and _raise(empty_valkey.url, 2)[0]
    assert not _raise(empty_valkey.url, 1)[0], "stable never goes back automatically"

    rec = manual.rollback(store, actor="test")
    assert rec.version == 1 and store.policy().hold == 1 and store.state(2).state == "rolled_back"
    # a reload of v2 or v3 (a new checkpoint, a reloader restart, a vLLM restart: all end in this raise)
    for v in (2, 3):
        assert _raise(empty_valkey.url, v) == (False, {"version": v, "result": "a manual decision holds stable"})
    assert store.policy().stable == 1

    manual.pin(store, 3, actor="test")  # another manual decision: still held (at the rolled-back-to stable)
    manual.pin(store, None, actor="test")
    assert store.policy().hold == 1 and _raise(empty_valkey.url, 3)[0] is False

    manual.set_paused(store, True, actor="test")
    manual.set_paused(store, False, actor="test")  # resume: the release
    assert store.policy().hold is None
    assert _raise(empty_valkey.url, 2) == (False, {"version": 2, "result": "rolled back before"}), "never v2 again"
    assert _raise(empty_valkey.url, 3)[0] and store.policy().stable == 3

    manual.set_paused(store, True, actor="test")
    assert _raise(empty_valkey.url, 4) == (False, {"version": 4, "result": "promotion paused"})
    assert store.policy().stable == 3


def test_a_concurrent_raise_and_rollback_never_lose_the_rollback(empty_valkey, redis_client) -> None:
    """The rollback checks stable in its own transaction: a raise slipping in between makes it retry, not vanish."""
    keys = Keys(JOB)
    store = RolloutStore(redis_client, keys)
    for v in (1, 2, 3):
        publish_loaded(redis_client, JOB, v)
    redis_client.hset(keys.policy, mapping=PolicyTable(stable=2).to_redis())
    real_policy = store.policy
    raced = []

    def policy_then_raise() -> PolicyTable:
        table = real_policy()
        if not raced:  # between the rollback's read and its write, the reloader makes v2 stable
            raced.append(_raise(empty_valkey.url, 3)[0])
        return table

    store.policy = policy_then_raise  # type: ignore[method-assign]
    rec = manual.rollback(store, 1, actor="test")
    assert raced == [True] and rec.version == 1 and rec.stable == 3, "retried against the raised table"
    t = real_policy()
    assert (t.stable, t.hold) == (1, 1) and store.state(3).state == "rolled_back"


# --- the gateway's weights gate ------------------------------------------------------------------------------------
def test_the_gate_drains_before_a_switch_and_labels_after_it() -> None:
    async def go() -> None:
        gate = WeightsGate()
        with pytest.raises(WeightsUnknown):
            await gate.enter(0.05)  # nobody said what vLLM holds: wait, then give up (the gateway answers 503)
        gate.open(1)
        assert await gate.enter(1) == 1  # a request in flight on v1
        shut = asyncio.create_task(gate.shut(5))
        await asyncio.sleep(0.05)
        assert not shut.done(), "the switch waits for the request in flight"
        waiting = asyncio.create_task(gate.enter(5))  # a new request arrives mid-switch
        await asyncio.sleep(0.05)
        assert not waiting.done()
        gate.leave()
        assert await shut is True
        gate.open(2)
        assert await waiting == 2, "it is sent, and labelled, only once vLLM holds v2"
        gate.leave()
        assert await gate.shut(0.05) is True and gate.inflight == 0
        gate.open(None)
        assert not gate.known

    asyncio.run(go())


def test_the_gate_drain_timeout_is_reported() -> None:
    async def go() -> None:
        gate = WeightsGate()
        gate.open(0)
        await gate.enter(1)
        assert await gate.shut(0.05) is False
        assert gate.view() == {"version": 0, "switching": True, "inflight": 1, "previewing": False}

    asyncio.run(go())


def test_only_loopback_may_drive_the_gate() -> None:
    gate = WeightsGate()
    app = Starlette(routes=[Route("/internal/weights", weights_endpoint(gate, {"127.0.0.1"}), methods=["GET", "POST"])])
    with TestClient(app) as c:  # TestClient's peer is "testclient", not loopback
        assert c.post("/internal/weights", json={"state": "serving", "version": 5}).status_code == 404
        assert c.get("/internal/weights").status_code == 404
    assert gate.version is None


# --- config: a weights mode that cannot serve two versions at once refuses a canary -------------------------------
def test_full_weights_refuse_an_explicit_canary_and_default_to_bluegreen() -> None:
    from onlinerl.config import ConfigError

    with pytest.raises(ConfigError) as err:
        from_mapping({"serving": {"weightsMode": "full"}, "rollout": {"strategy": "canary"}})
    message = str(err.value)
    assert "rollout.strategy: canary" in message and "serving.weightsMode: full" in message
    assert "set rollout.strategy: bluegreen" in message, "the message says what to do instead"
    assert from_mapping({"serving": {"weightsMode": "full"}}).rollout.strategy == "bluegreen"
    assert from_mapping({"serving": {"weightsMode": "full"}, "rollout": {"strategy": "direct"}}).rollout.strategy == (
        "direct"
    )
    assert from_mapping({"rollout": {"strategy": "canary"}}).rollout.strategy == "canary"  # LoRA: canary stays
    resolved = from_mapping({"serving": {"weightsMode": "full"}})
    assert from_mapping(resolved.dump()).rollout.strategy == "bluegreen", "the dumped form (ConfigMap) loads again"
