"""The rollout-records family on a real valkey, written by the gateway's own store (capture.RolloutStore, the record
script of onlinerl/dataplane/rollouts.py) and read by feedback's readers: per-record TTL, the per-tenant cap and its
eviction, and what eviction leaves to the silence sweeper. The same through the real gateway and vLLM is
tests/serving/test_record_bounds.py.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator

import orjson
import pytest
import redis
from prometheus_client import CollectorRegistry, Counter
from redis.asyncio import Redis as AsyncRedis

from onlinerl.config import ConfigError, FeedbackConfig, SilenceConfig, from_mapping
from onlinerl.dataplane import rollouts
from onlinerl.keys import Keys
from onlinerl.schemas import RolloutRecord, SamplingParams
from onlinerl.valkey import EmbeddedValkey, RedisUsers, ensure_users_file
from onlinerl_feedback.sweeper import SilenceSweeper
from onlinerl_serving.capture import RolloutStore

KEYS = Keys("rt")


@pytest.fixture
def server(tmp_path) -> Iterator[EmbeddedValkey]:
    srv = EmbeddedValkey(tmp_path / "valkey").start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def r(server: EmbeddedValkey) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(server.url)
    try:
        yield client
    finally:
        client.close()


def rec(tenant: str, prompt: str, finished: float | None = None) -> RolloutRecord:
    now = time.time() if finished is None else finished
    return RolloutRecord(
        rollout_id=f"cmpl-{uuid.uuid4().hex[:16]}",
        tenant=tenant,
        arm="stable",
        policy_version=0,
        served_model="onlinerl-base",
        user_hash="u1",
        prompt=prompt,
        prompt_token_ids=[1, 2, 3],
        completion="x = 1",
        completion_token_ids=[4, 5],
        behaviour_logprobs=[-0.1, -0.2],
        token_offsets=[0, 1],
        finish_reason="stop",
        sampling=SamplingParams(),
        created_at=now - 0.1,
        finished_at=now,
    )


def evicted_counter() -> Counter:
    return Counter("evicted", "test", ["tenant"], registry=CollectorRegistry())


def store_all(server: EmbeddedValkey, records: list[RolloutRecord], **kw) -> list[rollouts.RecordWritten]:
    """Write ``records`` in order through the gateway's store (each acknowledged before the next)."""

    async def go() -> list[rollouts.RecordWritten]:
        client = AsyncRedis.from_url(server.url)
        store = RolloutStore(client, KEYS, kw.pop("ttl", 1800), **kw)
        try:
            return [await store.store(x) for x in records]
        finally:
            await store.close()
            await client.aclose()

    return asyncio.run(go())


def present(r: redis.Redis, x: RolloutRecord) -> bool:
    return r.hget(KEYS.rollouts(x.tenant, x.prompt), x.rollout_id) is not None


def index(r: redis.Redis, tenant: str) -> list[str]:
    return [m.decode() for m in r.zrange(KEYS.rollouts_index(tenant), 0, -1)]


def test_each_record_has_its_own_ttl_not_refreshed_by_its_prompt(server, r) -> None:
    first = rec("acme", "P")
    store_all(server, [first])
    (left,) = r.execute_command("HTTL", KEYS.rollouts("acme", "P"), "FIELDS", 1, first.rollout_id)
    assert 1790 <= left <= 1800
    later = rec("acme", "P")
    store_all(server, [later])  # the same prompt again: the old record's own TTL does not move
    ttls = r.execute_command("HTTL", KEYS.rollouts("acme", "P"), "FIELDS", 2, first.rollout_id, later.rollout_id)
    assert ttls[0] <= left and 1790 <= ttls[1] <= 1800
    assert index(r, "acme") == [rollouts.member("P", first.rollout_id), rollouts.member("P", later.rollout_id)]


def test_a_repeated_prompts_old_record_expires_on_its_own(server, r) -> None:
    """TTL 1 s; the prompt is served again every few hundred ms (which used to keep the whole hash alive)."""
    old = rec("acme", "P")
    store_all(server, [old], ttl=1)
    deadline, newest = time.monotonic() + 10, old
    while present(r, old):
        assert time.monotonic() < deadline, "the old record outlived its TTL by 9 s"
        newest = rec("acme", "P")
        store_all(server, [newest], ttl=1)
        time.sleep(0.2)  # pacing of the repeated traffic, not a wait for the result (the loop's condition is)
    assert present(r, newest) and r.exists(KEYS.rollouts("acme", "P"))  # the hash lives on, the old record does not
    store_all(server, [rec("acme", "P")], ttl=1)  # the index is pruned by the next write: the old entry goes
    assert rollouts.member("P", old.rollout_id) not in index(r, "acme")


def test_a_tenant_over_its_cap_loses_its_oldest_and_the_counter_moves(server, r) -> None:
    t0 = time.time()
    beta = [rec("beta", f"B{i}", t0 + i) for i in range(2)]
    acme = [rec("acme", p, t0 + 10 + i) for i, p in enumerate(["A0", "A1", "A1", "A2", "A3"])]
    counter = evicted_counter()
    written = store_all(server, beta + acme, max_records_per_tenant=3, evicted=counter)
    assert [w.evicted for w in written] == [0, 0, 0, 0, 0, 1, 1]
    assert [present(r, x) for x in acme] == [False, False, True, True, True]  # oldest first, across prompts
    assert all(present(r, x) for x in beta)  # another tenant's records untouched
    assert index(r, "acme") == [rollouts.member(x.prompt, x.rollout_id) for x in acme[2:]]
    assert counter.labels("acme")._value.get() == 2 and counter.labels("beta")._value.get() == 0
    assert int(r.hget(KEYS.stats(0, "stable"), "served")) == 7  # every request still counted as served


def test_a_replayed_record_is_one_entry_and_evicts_nothing(server, r) -> None:
    x = rec("acme", "P")
    written = store_all(server, [x, x, x], max_records_per_tenant=1)
    assert [w.evicted for w in written] == [0, 0, 0]
    assert present(r, x) and index(r, "acme") == [rollouts.member("P", x.rollout_id)]


def test_a_forged_index_entry_cannot_evict_another_tenants_record(server, r) -> None:
    """Eviction names the hash from the tenant of the index it pops: a member naming beta's record (or garbage)
    deletes nothing of beta's."""
    victim = rec("beta", "B")
    store_all(server, [victim])
    digest = rollouts.member("B", victim.rollout_id).split(" ")[0]
    t = time.time() - 100  # older than anything written below, younger than the TTL (so not merely pruned)
    forged = {f"{digest} {victim.rollout_id}": t, "garbage-without-space": t + 1, " ": t + 2}
    r.zadd(KEYS.rollouts_index("acme"), forged)  # the oldest entries of acme's index
    mine = rec("acme", "A")
    written = store_all(server, [mine], max_records_per_tenant=1)
    assert written[0].evicted == 0  # three entries popped, none of them an acme record
    assert present(r, victim) and present(r, mine)
    assert index(r, "acme") == [rollouts.member("A", mine.rollout_id)]


def test_the_cap_is_validated_and_its_error_names_the_field() -> None:
    for bad in (0, -5, "many"):
        with pytest.raises(ConfigError, match="maxRecordsPerTenant"):
            from_mapping({"serving": {"maxRecordsPerTenant": bad}})
    assert from_mapping({}).serving.max_records_per_tenant == 50_000


def test_an_evicted_rollout_settles_as_expired_never_trained(server, r) -> None:
    """Silence on: the sweeper finds the evicted record gone (nothing trained) and trains the one still kept."""
    silence = SilenceConfig(window_seconds=5, tenants={"acme": True})
    t0 = time.time() - 60
    gone, kept = rec("acme", "A0", t0), rec("acme", "A1", t0 + 1)
    store_all(server, [gone, kept], max_records_per_tenant=1, silence=silence)

    async def go():
        client = AsyncRedis.from_url(server.url)
        try:
            return await SilenceSweeper(client, KEYS, FeedbackConfig(silence=silence)).sweep(time.time())
        finally:
            await client.aclose()

    counts = asyncio.run(go())
    assert counts["expired"] == 1 and counts["trained"] == 1
    assert [orjson.loads(f[b"data"])["event_id"] for _, f in r.xrange(KEYS.samples)] == [f"silence:{kept.rollout_id}"]
    # the silence mark lives as long as the record it guards
    rid_ttl, mark_ttl = r.execute_command(
        "HPTTL", KEYS.rollouts("acme", "A1"), "FIELDS", 2, kept.rollout_id, KEYS.rated_field(kept.rollout_id)
    )
    assert rid_ttl > 0 and abs(mark_ttl - rid_ttl) < 1000


def test_each_component_does_its_part_with_its_own_acl_user(tmp_path) -> None:
    """The gateway's record script (eviction and silence included) as the ``serving`` user, the sweeper as
    ``feedback``: nothing refused (ACL LOG empty); and ``feedback`` may not write the gateway's index."""
    srv = EmbeddedValkey(tmp_path / "acl", users=RedisUsers("rt", ensure_users_file(tmp_path / "users.yaml"))).start()
    admin = redis.Redis.from_url(srv.url)
    try:
        silence = SilenceConfig(window_seconds=5, tenants={"acme": True})
        t0 = time.time() - 60
        old, new = rec("acme", "A0", t0), rec("acme", "A1", t0 + 1)

        async def go():
            gw, fb = AsyncRedis.from_url(srv.url_for("gateway")), AsyncRedis.from_url(srv.url_for("feedback"))
            store = RolloutStore(gw, KEYS, 1800, silence, max_records_per_tenant=1)
            try:
                written = [await store.store(x) for x in (old, new)]
                counts = await SilenceSweeper(fb, KEYS, FeedbackConfig(silence=silence)).sweep(time.time())
                return written, counts
            finally:
                await store.close()
                await gw.aclose()
                await fb.aclose()

        written, counts = asyncio.run(go())
        assert [w.evicted for w in written] == [0, 1]
        assert (counts["expired"], counts["trained"]) == (1, 1)
        assert admin.acl_log() == []
        feedback = redis.Redis.from_url(srv.url_for("feedback"))
        try:
            with pytest.raises(redis.exceptions.NoPermissionError):
                feedback.zadd(KEYS.rollouts_index("acme"), {"forged": 1.0})
        finally:
            feedback.close()
    finally:
        admin.close()
        srv.stop()
