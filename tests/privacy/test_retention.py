"""Retention, stated in one place (``privacy.retention``) and enforced by the component that owns each kind of data
(issue 38): the audit stream by feedback's keeper, unacknowledged samples by the trainer, on the session's valkey."""

from __future__ import annotations

import asyncio
import time

import orjson
import pytest
import redis

from onlinerl.config import ConfigError, from_mapping
from onlinerl.dataplane import samples
from onlinerl.keys import SAMPLES_GROUP, Keys
from onlinerl.redisconn import connect_async
from onlinerl.valkey import EmbeddedValkey
from onlinerl_feedback.retention import RETENTION, AuditRetention

K = Keys("ret")
DAY = 24 * 3600


def test_retention_is_one_place_and_the_older_spellings_follow_it() -> None:
    cfg = from_mapping({})
    r = cfg.privacy.retention
    assert (r.rollout_records_seconds, r.checkpoints_keep, r.audit_seconds, r.pending_samples_seconds) == (
        1800,
        5,
        30 * DAY,
        7 * DAY,
    )
    old = from_mapping({"redis": {"rolloutTtlSeconds": 3600}, "trainer": {"checkpoint": {"keep": 2}}})
    assert (old.privacy.retention.rollout_records_seconds, old.privacy.retention.checkpoints_keep) == (3600, 2)
    # on Kubernetes the API server fills the older fields' defaults: a retention value still wins
    new = from_mapping(
        {
            "redis": {"rolloutTtlSeconds": 1800},
            "trainer": {"checkpoint": {"keep": 5}},
            "privacy": {"retention": {"rolloutRecordsSeconds": 7200, "checkpointsKeep": 3}},
        }
    )
    assert (new.redis.rollout_ttl_seconds, new.trainer.checkpoint.keep) == (7200, 3)  # what the components read
    assert from_mapping(new.dump()).privacy.retention == new.privacy.retention  # the operator's ConfigMap round trip
    with pytest.raises(ConfigError, match="auditSeconds"):
        from_mapping({"privacy": {"retention": {"auditSeconds": 60}}})
    with pytest.raises(ConfigError, match="secretScreening"):
        from_mapping({"privacy": {"secretScreening": "redact"}})


def test_feedback_trims_audit_entries_past_their_retention(empty_valkey: EmbeddedValkey, redis_client) -> None:
    now = time.time()
    old = [redis_client.xadd(K.audit, {"data": b"{}"}, id=f"{int((now - 40 * DAY) * 1000) + i}-0") for i in range(3)]
    recent = [redis_client.xadd(K.audit, {"data": b"{}"}, id=f"{int((now - DAY) * 1000) + i}-0") for i in range(2)]

    async def run() -> tuple[int, int]:
        client = connect_async(from_mapping({}).redis, empty_valkey.url)
        keeper = AuditRetention(client, K, 30 * DAY)
        try:
            return await keeper.enforce(now), await keeper.enforce(now)
        finally:
            await client.aclose()

    first, second = asyncio.run(run())
    assert (first, second) == (3, 0)  # the second check finds nothing due and writes nothing
    ids = [i for i, _ in redis_client.xrange(K.audit)]
    assert ids[:2] == recent and not set(old) & set(ids)
    [(_, fields)] = redis_client.xrange(K.audit, min=ids[2])
    assert orjson.loads(fields[b"data"])["outcome"] == RETENTION  # the trim says it ran


def test_the_trainer_s_keeper_deletes_unacknowledged_samples_past_their_retention(redis_client: redis.Redis) -> None:
    now = time.time()
    redis_client.xgroup_create(K.samples, SAMPLES_GROUP, id="0", mkstream=True)
    old = [redis_client.xadd(K.samples, {"data": b"{}"}, id=f"{int((now - 8 * DAY) * 1000) + i}-0") for i in range(4)]
    recent = [redis_client.xadd(K.samples, {"data": b"{}"}, id=f"{int(now * 1000) - 1000 + i}-0") for i in range(2)]
    redis_client.xreadgroup(SAMPLES_GROUP, "trainer-0", {K.samples: ">"}, count=5)  # 4 old + 1 recent pending
    assert samples.trim_expired(redis_client, K, int((now - 7 * DAY) * 1000)) == 4
    assert [i for i, _ in redis_client.xrange(K.samples)] == recent
    pending = redis_client.xpending_range(K.samples, SAMPLES_GROUP, min="-", max="+", count=10)
    assert [p["message_id"] for p in pending] == recent[:1]  # the old ones no longer wait for anyone
    assert old and samples.trim_expired(redis_client, K, int((now - 7 * DAY) * 1000)) == 0
