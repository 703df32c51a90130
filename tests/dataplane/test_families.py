"""The data-plane family modules against a real valkey: what each reader returns and each writer leaves behind,
including the hostile cases (stale expectations, malformed entries, another job's keys, an emptied script cache)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import redis.asyncio as aioredis

from onlinerl.arms import CANDIDATE, STABLE
from onlinerl.dataplane import audit, checkpoints, codec, decisions, holds, limits, policy, samples, stats, versions
from onlinerl.keys import SAMPLES_GROUP, Keys
from onlinerl.redis_pipe import PipelinedConnection
from onlinerl.rollout.records import DecisionRecord, RolloutState
from onlinerl.schemas import PolicyVersionState

K = Keys("dp")
OTHER = Keys("other")


def run_async(url: str, fn: Callable[[Any], Awaitable[Any]]) -> Any:
    async def main() -> Any:
        client = aioredis.from_url(url)
        try:
            return await fn(client)
        finally:
            await client.aclose()

    return asyncio.run(main())


# --- codec ---------------------------------------------------------------------------------------------------------
def test_codec_reads_resp2_lists_resp3_dicts_and_drops_deleted_entries() -> None:
    assert codec.str_map([b"a", b"1", "b", 2]) == {"a": "1", "b": "2"}
    assert codec.str_map({b"a": b"1"}) == {"a": "1"}
    assert codec.str_map(None) == {}
    assert codec.entries([(b"1-0", {b"data": b"x"}), (b"2-0", None)]) == [("1-0", {"data": b"x"})]


# --- decisions: the one atomic rollout write ---------------------------------------------------------------------
def test_apply_writes_table_verdict_and_record_together_and_snapshots_the_stable_arm(redis_client) -> None:
    redis_client.hset(K.stats(2, STABLE), mapping={"shown": 40, "accepted": 10})
    redis_client.hset(K.policy, mapping={"stable": 2})
    state = RolloutState(version=3, state="canary", stable_version=2)
    rec = DecisionRecord(decision="gate_pass", version=3, stable=2, reason="gate passed")
    entry = decisions.apply(
        redis_client,
        K,
        rec,
        expect_stable=2,
        expect_candidate=None,
        policy={"candidate": 3, "canary_share": 0.1, "paused": False},
        states=[state],
        snapshot_stable=2,
    )
    assert entry is not None
    table = policy.read(redis_client, K)
    assert (table.stable, table.candidate, table.canary_share, table.paused) == (2, 3, 0.1, False)
    verdict = decisions.verdict(redis_client, K, 3)
    assert verdict is not None and verdict.state == "canary"
    assert verdict.baseline == {"shown": "40", "accepted": "10"}  # copied inside the script, not by the caller
    [(entry_id, got)] = decisions.latest(redis_client, K, 5)
    assert entry_id == entry and got.decision == "gate_pass" and got.version == 3
    assert decisions.after(redis_client, K, entry_id) == []
    assert decisions.verdicts(redis_client, K) == {3: verdict}


def test_apply_with_a_stale_expectation_changes_nothing(redis_client) -> None:
    redis_client.hset(K.policy, mapping={"stable": 2, "candidate": 4})  # a rollback happened meanwhile
    rec = DecisionRecord(decision="promote", version=3, stable=2)
    for stale in ({"expect_stable": 1}, {"expect_candidate": 3}, {"expect_candidate": None}):
        assert decisions.apply(redis_client, K, rec, policy={"stable": 3}, **stale) is None
    assert policy.read(redis_client, K).stable == 2
    assert redis_client.exists(K.decisions, K.rollout) == 0  # no record, no verdict: all or nothing


def test_decisions_are_read_per_job_and_skip_entries_without_data(empty_valkey, redis_client) -> None:
    decisions.apply(redis_client, OTHER, DecisionRecord(decision="pin", version=1))
    redis_client.xadd(K.decisions, {"junk": "1"})  # not ours: no data field
    entry = decisions.apply(redis_client, K, DecisionRecord(decision="pause"))
    assert [r.decision for _, r in decisions.latest(redis_client, K)] == ["pause"]

    async def both(c: Any) -> tuple[list[str], list]:
        newest = await decisions.latest_async(c, K, 5)
        return [r.decision for _, r in newest], await decisions.after_async(c, K, entry or "0-0")

    assert run_async(empty_valkey.url, both) == (["pause"], [])


# --- policy: the direct raise ----------------------------------------------------------------------------------------
def test_raise_stable_refuses_what_the_table_or_a_verdict_forbids(empty_valkey, redis_client) -> None:
    async def scenario(c: Any) -> list[int]:
        codes = [await policy.raise_stable(c, K, 2)]  # empty table: stable 0 -> 2
        codes.append(await policy.raise_stable(c, K, 1))  # never back
        await c.script_flush()  # Redis restarted: the script cache is empty
        await c.hset(K.policy, "hold", "2")
        codes.append(await policy.raise_stable(c, K, 3))
        await c.hset(K.policy, mapping={"hold": "", "paused": "1"})
        codes.append(await policy.raise_stable(c, K, 3))
        await c.hset(K.policy, "paused", "0")
        await c.hset(K.rollout, "3", RolloutState(version=3, state="rolled_back").to_json())
        codes.append(await policy.raise_stable(c, K, 3))
        codes.append(await policy.raise_stable(c, K, 4))
        return codes

    codes = run_async(empty_valkey.url, scenario)
    assert codes == [policy.RAISED, 0, -1, -2, -3, policy.RAISED]
    assert [policy.NOT_RAISED[c] for c in codes[1:5]] == [
        "not newer",
        "a manual decision holds stable",
        "promotion paused",
        "rolled back before",
    ]
    assert policy.read(redis_client, K).stable == 4
    assert policy.read(redis_client, OTHER).stable == 0


def test_set_field_writes_only_a_change(empty_valkey, redis_client) -> None:
    async def scenario(c: Any) -> list[bool]:
        return [await policy.set_field(c, K, "pinned", "3"), await policy.set_field(c, K, "pinned", "3")]

    assert run_async(empty_valkey.url, scenario) == [True, False]
    assert policy.read(redis_client, K).pinned == 3


# --- versions, holds, stats, checkpoints -----------------------------------------------------------------------------
def test_versions_keep_malformed_entries_apart(redis_client) -> None:
    versions.report(redis_client, K, "r-0", [PolicyVersionState(version=1, state="loaded")], ttl=60)
    redis_client.hset(K.replica_versions("r-0"), "2", b"{not json")
    redis_client.hset(K.replica_versions("r-0"), "3", orjson.dumps({"version": 3, "state": "exploded"}))
    redis_client.hset(K.replica_versions("r-0"), "x", b"{}")  # not a version number: ignored
    table = versions.read(redis_client, K)
    assert set(table.states) == {1} and table.malformed == {2, 3} and table.loaded() == {1}
    assert table.in_use() == {1, 2, 3}  # unreadable entries are kept by the trainer


def test_holds_expire_and_ignore_malformed_fields(empty_valkey, redis_client) -> None:
    assert holds.hold(redis_client, K, [0, 2, 2, 5], seconds=300) == [2, 5]
    holds.hold(redis_client, K, [7], seconds=-1)
    redis_client.hset(K.holds, mapping={"v9": "9e12", "8": "soon"})
    assert run_async(empty_valkey.url, lambda c: holds.read_async(c, K)) == {2, 5}
    holds.release(redis_client, K, [2, 7])
    assert run_async(empty_valkey.url, lambda c: holds.read_async(c, K)) == {5}


def test_stats_read_all_skips_foreign_and_malformed_keys(redis_client) -> None:
    redis_client.hset(K.stats(1, CANDIDATE), mapping={"shown": 5, "accepted": 2})
    redis_client.hset(f"{K.prefix}stats:vX:stable", mapping={"shown": 1})
    redis_client.hset(OTHER.stats(1, STABLE), mapping={"shown": 9})
    assert stats.read_all(redis_client, K) == {(1, CANDIDATE): {"shown": 5, "accepted": 2}}
    assert stats.read(redis_client, K, 1, CANDIDATE).accepted == 2
    assert stats.read(redis_client, K, 2, STABLE).shown == 0


def test_checkpoints_are_read_in_order_with_str_fields(empty_valkey, redis_client) -> None:
    assert checkpoints.last_announced(redis_client, K) == 0
    first = redis_client.xadd(K.checkpoints, {"version": "1", "path": "/c/v1"}).decode()
    redis_client.xadd(K.checkpoints, {"version": "2", "path": "/c/v2"})
    assert checkpoints.last_announced(redis_client, K) == 2
    got = run_async(empty_valkey.url, lambda c: checkpoints.read_after(c, K, "0"))
    assert [f for _, f in got] == [{"version": "1", "path": "/c/v1"}, {"version": "2", "path": "/c/v2"}]
    later = run_async(empty_valkey.url, lambda c: checkpoints.read_after(c, K, first, block_ms=10))
    assert [f["version"] for _, f in later] == ["2"]


# --- samples, audit, limits ------------------------------------------------------------------------------------------
def test_backlog_counts_the_group_lag(empty_valkey, redis_client) -> None:
    assert run_async(empty_valkey.url, lambda c: samples.backlog(c, K)) == (0, 0)  # no stream yet
    for i in range(3):
        samples.add(redis_client, K, orjson.dumps({"i": i}))
    assert run_async(empty_valkey.url, lambda c: samples.backlog(c, K)) == (3, 3)  # no group: nothing delivered
    redis_client.xgroup_create(K.samples, SAMPLES_GROUP, id="0")
    redis_client.xreadgroup(SAMPLES_GROUP, "t", {K.samples: ">"}, count=2)
    assert run_async(empty_valkey.url, lambda c: samples.backlog(c, K)) == (3, 1)
    assert samples.length(redis_client, K) == 3
    assert [orjson.loads(d)["i"] for _, d in samples.read_all(redis_client, K)] == [0, 1, 2]


def test_sample_entries_without_data_decode_to_empty(redis_client) -> None:
    from onlinerl.dataplane.trainer import Lease

    redis_client.xadd(K.samples, {"other": "x"})  # forged or corrupt: the trainer must see it to discard it
    stream = samples.SampleStream(redis_client, K, Lease(redis_client, K, "t"), consumer="t")
    stream.ensure_group()
    stream.ensure_group()  # idempotent (BUSYGROUP)
    [entry] = stream.read_new(10, 10)
    assert entry.data == b""
    assert [e.sample_id for e in stream.own_pending()] == [entry.sample_id]
    assert stream.pending_count() == 1


def test_audit_append_is_capped_and_returns_the_id(empty_valkey, redis_client) -> None:
    async def scenario(c: Any) -> str:
        conn = PipelinedConnection(c)
        try:
            return await audit.append(conn, K, b'{"why": "dup"}')
        finally:
            await conn.close()

    entry_id = run_async(empty_valkey.url, scenario)
    assert audit.read(redis_client, K) == [(entry_id, b'{"why": "dup"}')]


def test_release_drops_the_mark_and_the_users_counters_only(empty_valkey, redis_client) -> None:
    redis_client.set(K.quarantine("acme", "u1"), "why")
    redis_client.hset(K.user_stats("acme", "u1"), "shown", 3)
    redis_client.hset(K.user_stats("acme"), "shown", 9)
    assert run_async(empty_valkey.url, lambda c: limits.release(c, K, "acme", "u1")) is True
    assert run_async(empty_valkey.url, lambda c: limits.release(c, K, "acme", "u1")) is False
    assert redis_client.exists(K.quarantine("acme", "u1"), K.user_stats("acme", "u1")) == 0
    assert redis_client.hget(K.user_stats("acme"), "shown") == b"9"  # the tenant's figures stay
