"""Rate only your own rollouts (issue 35) through the real gateway (shared vLLM engine on CPU) and the real feedback
service, each connected to a real valkey as its own ACL user (``gateway``, ``feedback``), as `onlinerl up` runs them.

Alice is served a completion; Mallory, another key of the same tenant, uploads Alice's shown text as her own accept.
It is audited (``not_own_rollout``), nothing trains or counts, and Alice's own rating still trains, counted against
Alice. Neither service was refused anything by Redis on this path (ACL LOG empty).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest
import redis

from onlinerl.auth import KeyRing, user_hash
from onlinerl.dataplane import acl
from onlinerl.fim import get_template
from onlinerl.keys import Keys
from onlinerl.loop.continue_client import ContinueClient
from onlinerl.schemas import RolloutRecord
from onlinerl.valkey import EmbeddedValkey, RedisUsers
from onlinerl_feedback.limits import user_of
from tests.engines import SharedEngine
from tests.feedback.conftest import JOB
from tests.feedback.gateway_stack import as_own_users
from tests.feedback.test_rollout_rules_through_gateway import serve

QWEN = get_template("qwen")
ALICE, MALLORY = "key-acme-alice", "key-acme-mallory"
TENANTS = {"acme": [ALICE, MALLORY]}
K = Keys(JOB)


@pytest.fixture(scope="module")
def vk(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedValkey]:
    server = EmbeddedValkey(tmp_path_factory.mktemp("own") / "valkey", users=RedisUsers(JOB, acl.new_passwords()))
    server.start()
    try:
        yield server
    finally:
        server.stop()


async def rate(client: ContinueClient, prompt: str, shown: str) -> tuple[int, dict]:
    body = client.outcome(
        prompt=prompt, prefix="", suffix="", filepath="a.py", shown=shown, accepted=True, latency_ms=1
    )
    async with httpx.AsyncClient(timeout=60) as http:
        return await client.post_outcome(http, body)


def contributions(admin: redis.Redis, key: str) -> int:
    identity = KeyRing.from_mapping({"tenants": {"acme": {"keys": TENANTS["acme"]}}}).identity_for(key)
    assert identity is not None
    pattern = K.contrib("acme", user_of(identity.key_id), 0).rsplit(":", 1)[0] + ":*"
    return sum(int(admin.get(k) or 0) for k in admin.scan_iter(match=pattern))


@pytest.mark.vllm
def test_a_key_cannot_rate_what_the_gateway_served_another_key(
    vk: EmbeddedValkey, tmp_path: Path, tiny_lora_engine: SharedEngine
) -> None:
    with as_own_users(vk, tmp_path, tiny_lora_engine, TENANTS) as (admin, ep):
        alice = ContinueClient(ep.api, ep.track, ALICE, "acme", "onlinerl-base", QWEN, max_tokens=8)
        mallory = ContinueClient(ep.api, ep.track, MALLORY, "acme", "onlinerl-base", QWEN, max_tokens=8)
        prompt, res = asyncio.run(serve(alice, "own"))
        [raw] = admin.hvals(K.rollouts("acme", prompt))
        record = RolloutRecord.model_validate_json(raw)
        assert record.user_hash == user_hash(ALICE)  # the gateway names the user it served

        code, reply = asyncio.run(rate(mallory, prompt, res.text))
        assert code == 200 and (reply["status"], reply["reason"]) == ("rejected", "not_own_rollout"), reply
        assert admin.xlen(K.samples) == 0
        [(_, fields)] = admin.xrange(K.audit)
        audited = orjson.loads(fields[b"data"])
        assert (audited["reason"], audited["rollout_id"]) == ("not_own_rollout", record.rollout_id)
        assert contributions(admin, MALLORY) == 0
        shown = {k: v for k, v in admin.hgetall(K.stats(record.policy_version, record.arm)).items() if k != b"served"}
        assert shown == {}  # Mallory moved no counter of Alice's arm

        code, reply = asyncio.run(rate(alice, prompt, res.text))
        assert code == 200 and reply["status"] == "accepted_for_training", reply
        assert reply["rollout_id"] == record.rollout_id
        [(_, fields)] = admin.xrange(K.samples)
        assert orjson.loads(fields[b"data"])["rollout_id"] == record.rollout_id
        assert contributions(admin, ALICE) == 1 and contributions(admin, MALLORY) == 0
