"""Each component works THROUGH ITS REAL CODE as its own Redis ACL user, and nothing else can feed the trainer.

Real valkey started with the aclfile generated from the contract (default user off), real vLLM on CPU (tiny model),
the real gateway and feedback processes each connecting as its own user, the trainer's real lease and stream code,
the real rollout controller. ``ACL LOG`` proves no component was refused anything on its normal path.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis

from onlinerl.config import RolloutConfig
from onlinerl.dataplane.contract import Component
from onlinerl.dataplane.samples import SampleStream
from onlinerl.dataplane.trainer import Lease
from onlinerl.fim import get_template
from onlinerl.keys import Keys
from onlinerl.loop.continue_client import CompletionResult, ContinueClient
from onlinerl.schemas import PolicyTable
from onlinerl.valkey import EmbeddedValkey, RedisUsers, ensure_users_file
from onlinerl_rollout.controller import EvalRequest, RolloutController
from onlinerl_rollout.gate import EvalRecord, GateInput
from tests.engines import SharedEngine
from tests.feedback.conftest import JOB, KEYS
from tests.feedback.gateway_stack import gateway_and_feedback
from tests.rollout.sim import ArmSimulator, Truth, publish_loaded

QWEN = get_template("qwen")
K = Keys(JOB)
REFUSED = (redis.exceptions.NoPermissionError, redis.exceptions.AuthenticationError, redis.exceptions.ResponseError)


def client_of(vk: EmbeddedValkey, user: str) -> redis.Redis:
    return redis.Redis.from_url(vk.url_for(user), socket_timeout=10)


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def served_ids(admin: redis.Redis) -> set[str]:
    """Rollout ids of every record the gateway wrote (field names of the ``rollouts:*`` hashes, not ``rated:``)."""
    ids = set()
    for key in admin.scan_iter(match=f"{K.prefix}rollouts:*"):
        ids |= {_text(f) for f in admin.hkeys(key) if not _text(f).startswith("rated:")}
    return ids


def denials(admin: redis.Redis) -> list[dict]:
    """ACL LOG entries (every refused command or key since the last reset)."""
    return [{k.decode() if isinstance(k, bytes) else k: v for k, v in e.items()} for e in admin.acl_log()]


@pytest.fixture(scope="module")
def vk(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedValkey]:
    tmp = tmp_path_factory.mktemp("acl-components")
    server = EmbeddedValkey(tmp / "valkey", users=RedisUsers(JOB, ensure_users_file(tmp / "users.yaml"))).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def admin(vk: EmbeddedValkey) -> Iterator[redis.Redis]:
    """The admin client on an emptied server with an empty ACL LOG."""
    client = redis.Redis.from_url(vk.url)
    client.flushall()
    client.acl_log_reset()
    yield client
    client.close()


# --- without vLLM: the rollout controller, the trainer's lease and stream ---------------------------------------
def good_eval(req: EvalRequest) -> GateInput:
    recs = [EvalRecord(f"return x + {i}", i % 3 == 0) for i in range(req.samples)]
    return GateInput(req.candidate, req.stable, recs, recs)


def test_rollout_controller_writes_the_policy_table_as_rollout(vk: EmbeddedValkey, admin: redis.Redis) -> None:
    """The real controller gates v1 into the canary and promotes it, as user ``rollout``; the reloader's versions are
    reported as ``reloader``. The simulated traffic (tests/rollout/sim.py) plays the gateway and feedback on one
    connection, so it runs as ``admin``: each of those two users is held to its own rights through its real service
    below and in test_acl_least_privilege.py."""
    admin.hset(K.policy, mapping=PolicyTable(stable=0).to_redis())
    serving, rollout, reloader = client_of(vk, "admin"), client_of(vk, "rollout"), client_of(vk, "reloader")
    try:
        publish_loaded(reloader, JOB, 1)
        clock = {"now": 1_000_000.0}
        cfg = RolloutConfig(strategy="canary", canary_share=0.5, min_samples=200, min_dwell_seconds=60.0)
        ctl = RolloutController(rollout, JOB, cfg, good_eval, clock=lambda: clock["now"])
        [gate] = ctl.tick()
        assert gate.decision == "gate_pass" and PolicyTable.from_redis(admin.hgetall(K.policy)).candidate == 1
        sim = ArmSimulator(serving, JOB, {0: Truth(0.2), 1: Truth(0.4)})
        decided = []
        for _ in range(60):
            sim.serve(100)
            clock["now"] += 10
            decided += ctl.tick()
            if decided and decided[-1].decision in ("promote", "rollback"):
                break
        assert decided[-1].decision == "promote"
        table = PolicyTable.from_redis(admin.hgetall(K.policy))
        assert table.stable == 1 and table.candidate is None
        assert admin.xlen(K.decisions) == 2 and denials(admin) == []
        with pytest.raises(redis.exceptions.NoPermissionError):
            rollout.xadd(K.samples, {"data": "{}"})  # the controller routes; it never trains
    finally:
        serving.close()
        rollout.close()
        reloader.close()


def test_trainer_lease_stream_read_and_ack_as_trainer(vk: EmbeddedValkey, admin: redis.Redis) -> None:
    feedback, trainer = client_of(vk, "feedback"), client_of(vk, "trainer")
    try:
        ids = [feedback.xadd(K.samples, {"data": json.dumps({"n": i})}).decode() for i in range(3)]
        lease = Lease(trainer, K, "trainer-0", ttl_ms=5_000)
        assert lease.try_acquire() is None and lease.token >= 1
        stream = SampleStream(trainer, K, lease)
        stream.ensure_group()
        got = stream.read_new(10, 100)
        assert [e.sample_id for e in got] == ids
        assert stream.ack([e.sample_id for e in got]) == 3
        assert stream.pending_count() == 0 and admin.xlen(K.samples) == 0  # acked and deleted
        lease.announce({"version": "1", "path": "/ckpt/fbtest/v1"})
        assert admin.xlen(K.checkpoints) == 1
        lease.release()
        assert denials(admin) == []
        with pytest.raises(redis.exceptions.NoPermissionError):
            trainer.hset(K.policy, "stable", "7")
        with pytest.raises(redis.exceptions.NoPermissionError):
            trainer.hset(K.replica_versions("r-0"), "7", "{}")
        assert admin.hget(K.policy, "stable") is None
    finally:
        feedback.close()
        trainer.close()


def test_feedback_service_appends_a_sample_as_feedback(vk: EmbeddedValkey, admin: redis.Redis, tmp_path: Path) -> None:
    """Without vLLM: the gateway's own record script (``rollouts.record_command``) as ``gateway``, then the real
    feedback service, connected as ``feedback``, joins a Continue event to it and appends one training sample."""
    from transformers import AutoTokenizer

    from onlinerl.dataplane.rollouts import record_command
    from onlinerl.model import bootstrap_smollm2
    from tests.feedback.conftest import event, headers, start_feedback
    from tests.feedback.rollouts import make_rollout

    tokenizer = AutoTokenizer.from_pretrained(str(bootstrap_smollm2()))
    prompt = QWEN.render("def add(a, b):\n", "\n\nprint(add(1, 2))\n")
    record = make_rollout(tokenizer, tenant="acme", prompt=prompt, completion="    return a + b")
    serving = client_of(vk, "gateway")
    try:
        serving.execute_command(*record_command(K, record, 1800, 1000, False))
    finally:
        serving.close()
    fb = start_feedback(tmp_path, vk.url_for("feedback"))
    try:
        resp = httpx.post(f"{fb.url}/api/training/submit", json=event(prompt, "    return a + b"), headers=headers())
        assert resp.status_code == 200 and resp.json()["status"] == "accepted_for_training", resp.text
        [(_, fields)] = admin.xrange(K.samples)
        assert json.loads(fields[b"data"])["rollout_id"] == record.rollout_id
        assert denials(admin) == []
        # A forged sample from the same service's neighbour: the gateway's user cannot add one.
        with pytest.raises(redis.exceptions.NoPermissionError):
            client_of(vk, "gateway").xadd(K.samples, {"data": fields[b"data"]})
        assert admin.xlen(K.samples) == 1
    finally:
        fb.stop()


# --- with vLLM: the gateway's record, feedback's sample, nothing injected reaches training ----------------------
@dataclass
class Live:
    user: ContinueClient
    vk: EmbeddedValkey


@pytest.fixture(scope="module")
def live(
    vk: EmbeddedValkey, tmp_path_factory: pytest.TempPathFactory, tiny_lora_engine: SharedEngine
) -> Iterator[Live]:
    tmp = tmp_path_factory.mktemp("gw")
    tenants = {"acme": list(KEYS["acme"])}
    with gateway_and_feedback(
        tmp, vk.url_for("gateway"), tiny_lora_engine, tenants, feedback_redis_url=vk.url_for("feedback")
    ) as ep:
        user = ContinueClient(ep.api, ep.track, KEYS["acme"][0], "acme", "onlinerl-base", QWEN, max_tokens=8)
        yield Live(user, vk)


async def serve_and_rate(client: ContinueClient, prefix: str) -> tuple[CompletionResult, int, dict]:
    async with httpx.AsyncClient(timeout=120) as http:
        for i in range(20):
            prompt = QWEN.render(f"{prefix}_{i} = ", "\n")
            res = await client.complete(http, prompt)
            assert res.status == 200 and not res.error, res.error
            if res.text.strip():
                body = client.outcome(
                    prompt=prompt, prefix="", suffix="", filepath="a.py", shown=res.text, accepted=True, latency_ms=1
                )
                code, reply = await client.post_outcome(http, body)
                return res, code, reply
    raise AssertionError("no non-empty completion")


@pytest.mark.vllm
def test_gateway_and_feedback_work_as_their_own_users(live: Live, admin: redis.Redis) -> None:
    """The gateway writes its rollout record and arm counter as ``gateway``; feedback joins the rating to it and
    appends one training sample as ``feedback``; neither was refused anything (ACL LOG empty)."""
    res, code, reply = asyncio.run(serve_and_rate(live.user, "acl_gw"))
    assert code == 200 and reply.get("status") == "accepted_for_training", reply
    assert len(list(admin.scan_iter(match=f"{K.prefix}rollouts:acme:*"))) >= 1
    served = sum(int(admin.hget(k, "served") or 0) for k in admin.scan_iter(match=f"{K.prefix}stats:*"))
    assert served >= 1
    [(_, fields)] = admin.xrange(K.samples)
    assert json.loads(fields[b"data"])["rollout_id"] in served_ids(admin)  # the gateway's record, as served
    assert res.text and denials(admin) == []


@pytest.mark.vllm
def test_an_injected_sample_never_reaches_training(live: Live, admin: redis.Redis) -> None:
    """Forged XADDs to the samples stream (no password, a wrong one, another component's user) are refused; the
    trainer's group then delivers exactly the one sample that came through the authorised path."""
    vk = live.vk
    forged = {"data": json.dumps({"rollout_id": "forged", "completion_token_ids": [10**9], "reward": 1e9})}
    base = f"127.0.0.1:{vk.port}/0"
    attackers = [
        f"redis://{base}",
        f"redis://feedback:{'0' * 48}@{base}",
        f"redis://default:{'0' * 48}@{base}",
        vk.url_for("gateway"),
        vk.url_for("reloader"),
        vk.url_for("rollout"),
        vk.url_for("operator"),
    ]
    for url in attackers:
        attacker = redis.Redis.from_url(url, socket_timeout=5)
        try:
            with pytest.raises(REFUSED):
                attacker.xadd(K.samples, forged)
        finally:
            attacker.close()
    assert admin.xlen(K.samples) == 0
    _, code, reply = asyncio.run(serve_and_rate(live.user, "acl_inject"))
    assert code == 200 and reply.get("status") == "accepted_for_training", reply
    trainer = client_of(vk, Component.TRAINER.value)
    try:
        lease = Lease(trainer, K, "trainer-0", ttl_ms=5_000)
        assert lease.try_acquire() is None
        stream = SampleStream(trainer, K, lease)
        stream.ensure_group()
        got = stream.read_new(100, 100)
        assert len(got) == 1 and json.loads(got[0].data)["rollout_id"] in served_ids(admin)
        assert b"forged" not in got[0].data
        assert stream.ack([got[0].sample_id]) == 1
        lease.release()
    finally:
        trainer.close()
    log = {(_text(e["reason"]), _text(e["username"])) for e in denials(admin)}
    refused_keys = {u for reason, u in log if reason != "auth"}
    assert refused_keys == {"gateway", "reloader", "rollout", "operator"}
    assert {u for reason, u in log if reason == "auth"} <= {"feedback", "default"}  # refused logins
