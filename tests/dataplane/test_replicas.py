"""Per-replica serving state against a real valkey: each replica's own versions hash plus a heartbeat, the job-wide
aggregate the controller reads, the union the trainer's pruning keeps, and a lapsed replica dropping out.

No vLLM: the replicas here are the reloader's real state writes (``versions.report``/``save_state``/``beat_async``,
and a real ``Reloader`` for strategy direct) without an engine; the trainer's real ``Publisher`` prunes a real
checkpoint folder; the real rollout controller ticks.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from onlinerl.config import RolloutConfig, from_mapping
from onlinerl.dataplane import holds, versions
from onlinerl.keys import Keys
from onlinerl.procs import wait_for
from onlinerl.schemas import PolicyTable, PolicyVersionState
from onlinerl.valkey import EmbeddedValkey, RedisUsers, ensure_users_file
from onlinerl_rollout.controller import EvalRequest, RolloutController
from onlinerl_rollout.gate import EvalRecord, GateInput
from onlinerl_serving.reloader import Reloader, ReloaderOptions
from onlinerl_serving.routing import route, user_hash
from onlinerl_trainer.checkpoint import MANIFEST
from onlinerl_trainer.publisher import Publisher
from tests.dataplane.test_families import run_async

LONG = 3600.0  # a heartbeat that does not lapse during a test


def st(v: int, state: str = "loaded") -> PolicyVersionState:
    return PolicyVersionState(version=v, state=state, path=f"/c/v{v}", served_model=f"j-v{v}")  # type: ignore[arg-type]


# --- the aggregate (pure) --------------------------------------------------------------------------------------------
def test_aggregate_is_loaded_only_where_every_live_replica_has_it() -> None:
    a = {1: st(1), 2: st(2), 3: st(3, "loading"), 5: st(5, "failed")}
    b = {1: st(1), 2: st(2, "retired"), 4: st(4), 5: st(5)}
    agg = versions.aggregate({"a": a, "b": b})
    assert {v: s.state for v, s in agg.items()} == {1: "loaded", 2: "retired", 3: "loading", 4: "loading", 5: "failed"}
    assert agg[1].path == "/c/v1" and agg[5].error == ""
    # Full weights: one replica holds v7, the other verified it (switchable): ready everywhere, not loaded.
    assert versions.aggregate({"a": {7: st(7)}, "b": {7: st(7, "ready")}})[7].state == "ready"
    assert versions.aggregate({"a": {7: st(7)}})[7].state == "loaded"  # one live replica: its own state
    assert versions.aggregate({}) == {}
    failed = PolicyVersionState(version=8, state="failed", error="disk", failures=3)
    assert versions.aggregate({"a": {8: failed}, "b": {8: st(8)}})[8].error == "a: disk"


def test_live_ids_drop_lapsed_and_hostile_members() -> None:
    raw = [
        (b"r-a", 110.0),
        (b"r-b", 99.0),
        (b"r-*", 200.0),
        (b"x}:versions:evil", 200.0),
        (b"", 200.0),
        (b"\xff\xfe", 200.0),
    ]
    assert versions.live_ids(raw, now=100.0) == ["r-a"]
    for bad in ("r-*", "a?b", "[ab]", "j}:x", "a:b", "", "-lead", "x" * 254, "a b", "r-a\n"):
        with pytest.raises(ValueError, match="ONLINERL_REPLICA must be"):
            versions.check_replica(bad)
    assert versions.check_replica("serving-7d9f-abc.x_1") == "serving-7d9f-abc.x_1"


# --- real valkey -----------------------------------------------------------------------------------------------------
def test_two_replicas_at_different_versions(valkey, redis_client) -> None:
    keys = Keys("two")
    assert versions.read(redis_client, keys).states == {}  # no live replica: nothing is loaded job-wide
    versions.report(redis_client, keys, "r-a", [st(1), st(2), st(3)], ttl=LONG)
    versions.report(redis_client, keys, "r-b", [st(1), st(2), st(3, "loading")], ttl=LONG)
    table = versions.read(redis_client, keys)
    assert versions.live_replicas(redis_client, keys) == ["r-a", "r-b"]
    assert table.loaded() == {1, 2} and table.states[3].state == "loading"
    assert table.in_use() == {1, 2, 3}
    assert {r: sorted(s) for r, s in table.replicas.items()} == {"r-a": [1, 2, 3], "r-b": [1, 2, 3]}
    # Each replica writes its own key: r-b's write never overwrites r-a's state (no last writer wins).
    versions.report(redis_client, keys, "r-b", [st(1, "retired")], ttl=LONG)
    assert versions.read_replica(redis_client, keys, "r-a")[1].state == "loaded"
    assert versions.read(redis_client, keys).states[1].state == "retired"


def test_a_lapsed_heartbeat_drops_the_replica_and_its_versions(valkey, redis_client) -> None:
    keys = Keys("lapse")
    versions.report(redis_client, keys, "r-a", [st(1), st(2)], ttl=LONG)
    versions.report(redis_client, keys, "r-b", [st(1), st(3)], ttl=1.0)  # dies: no beat after this one
    before = versions.read(redis_client, keys)
    assert before.loaded() == {1} and before.in_use() == {1, 2, 3}
    wait_for(lambda: versions.live_replicas(redis_client, keys) == ["r-a"], 5, 0.05, "r-b lapsed")
    after = versions.read(redis_client, keys)
    assert after.loaded() == {1, 2} and after.in_use() == {1, 2}  # v3 pinned by r-b alone: no longer
    ttl_ms = redis_client.pttl(keys.replica_versions("r-b"))
    assert 3_500_000 < ttl_ms <= 3_601_000, "its hash expires by itself an hour after its deadline (garbage)"
    # It comes back (its vLLM was down a while): one beat and it counts again, with the states it wrote before
    # (a reloader writes a version's state only when it changes, so they must still be there).
    versions.report(redis_client, keys, "r-b", ttl=LONG)
    back = versions.read(redis_client, keys)
    assert back.loaded() == {1} and back.in_use() == {1, 2, 3}


def test_hostile_members_and_other_jobs_are_ignored(valkey, redis_client) -> None:
    keys, other = Keys("mine"), Keys("other")
    versions.report(redis_client, keys, "r-a", [st(1)], ttl=LONG)
    versions.report(redis_client, other, "r-a", [st(1, "retired"), st(9)], ttl=LONG)  # same id, another job
    versions.report(redis_client, other, "r-x", [st(4)], ttl=LONG)
    # Forged members (an admin-level writer gone wrong): glob characters, a brace/colon escape to another job's key.
    redis_client.zadd(keys.replicas, {"r-*": 9e12, "x}:versions:r-x": 9e12, "*": 9e12, b"\xff": 9e12})
    redis_client.hset(keys.prefix + "versions:r-*", "1", st(1, "retired").to_json())
    table = versions.read(redis_client, keys)
    assert list(table.replicas) == ["r-a"] and table.loaded() == {1} and table.in_use() == {1}
    assert versions.read(redis_client, other).loaded() == set()  # the other job: its own view, untouched
    assert versions.read(redis_client, other).in_use() == {4, 9}
    with pytest.raises(ValueError, match="ONLINERL_REPLICA"):
        versions.report(redis_client, keys, "r-*", [st(2)])
    with pytest.raises(ValueError, match="ONLINERL_REPLICA"):
        versions.read_replica(redis_client, keys, "x}:versions:r-x")


def test_the_controller_gates_only_what_every_live_replica_loaded(valkey, redis_client) -> None:
    job = "gate"
    keys = Keys(job)
    redis_client.hset(keys.policy, mapping=PolicyTable(stable=0).to_redis())

    def evaluator(req: EvalRequest) -> GateInput:
        recs = [EvalRecord(f"return x + {i}", i % 3 == 0) for i in range(req.samples)]
        return GateInput(req.candidate, req.stable, recs, recs)

    cfg = RolloutConfig(strategy="canary", canary_share=0.5, min_samples=200, min_dwell_seconds=60.0)
    ctl = RolloutController(redis_client, job, cfg, evaluator)
    versions.report(redis_client, keys, "r-a", [st(1)], ttl=LONG)
    versions.report(redis_client, keys, "r-b", [st(1, "loading")], ttl=1.0)
    assert ctl.tick() == [] and PolicyTable.from_redis(redis_client.hgetall(keys.policy)).candidate is None
    # r-b dies before loading it: the switch completes for the live set.
    wait_for(lambda: versions.live_replicas(redis_client, keys) == ["r-a"], 5, 0.05, "r-b lapsed")
    [rec] = ctl.tick()
    assert (rec.decision, rec.version) == ("gate_pass", 1)
    assert PolicyTable.from_redis(redis_client.hgetall(keys.policy)).candidate == 1


def write_versions(root: Path, job: str, upto: int) -> Path:
    for v in range(1, upto + 1):
        (root / job / f"v{v}").mkdir(parents=True)
        (root / job / f"v{v}" / MANIFEST).write_text("{}")
    return root / job


def test_the_trainer_never_prunes_what_a_live_replica_or_a_hold_uses(valkey, redis_client, tmp_path) -> None:
    job = "prune"
    keys = Keys(job)
    cfg = from_mapping(
        {"job": job, "storage": {"checkpointDir": str(tmp_path)}, "trainer": {"checkpoint": {"keep": 1}}}
    )
    folder = write_versions(tmp_path, job, 8)
    pub = Publisher(cfg, redis_client, None, None, None, tmp_path)  # type: ignore[arg-type]  # pruning only
    redis_client.hset(keys.policy, mapping=PolicyTable(stable=6, candidate=7, canary_share=0.1).to_redis())
    versions.report(redis_client, keys, "r-a", [st(1, "retired"), st(2), st(6), st(7)], ttl=LONG)
    versions.report(redis_client, keys, "r-b", [st(3, "loading"), st(6), st(7, "retired")], ttl=1.0)
    holds.hold(redis_client, keys, [4], seconds=LONG)
    assert pub.protected_versions() == {2, 3, 4, 6, 7}
    assert pub.store.prune(cfg.trainer.checkpoint.keep, pub.protected_versions()) == [1, 5]
    assert sorted(int(p.name[1:]) for p in folder.iterdir() if p.name.startswith("v")) == [2, 3, 4, 6, 7, 8]
    # r-b's heartbeat lapses: v3 (only r-b had it) stops pinning; the hold released, v4 goes too.
    wait_for(lambda: versions.live_replicas(redis_client, keys) == ["r-a"], 5, 0.05, "r-b lapsed")
    holds.release(redis_client, keys, [4])
    assert pub.store.prune(cfg.trainer.checkpoint.keep, pub.protected_versions()) == [3, 4]


def test_a_replica_without_the_tables_version_serves_and_records_its_newest_below() -> None:
    """The gateway's routing (``route``): the Route's ``version`` is what its rollout record carries."""
    table = PolicyTable(stable=3)
    r = route(table, user_hash("k"), loaded={0, 1, 2})
    assert (r.arm, r.version, r.routed_version) == ("stable", 2, 3)
    assert route(table, user_hash("k"), loaded={0, 1, 2, 3}).version == 3


# --- a real Reloader (no engine): heartbeat, leave, strategy direct ---------------------------------------------------
def reloader(url: str, client: Any, replica: str, strategy: str = "direct") -> Reloader:
    cfg = from_mapping({"job": "direct", "redis": {"url": url}, "rollout": {"strategy": strategy}})
    rl = Reloader(
        cfg,
        client,
        httpx.AsyncClient(base_url="http://127.0.0.1:9"),
        httpx.AsyncClient(base_url="http://127.0.0.1:9"),
        options=ReloaderOptions(heartbeat_seconds=0.1, heartbeat_ttl_seconds=1.0),
        replica=replica,
    )
    rl.engine_seen_up = True
    return rl


def test_direct_raises_stable_only_once_every_live_replica_loaded_it(valkey, redis_client) -> None:
    keys = Keys("direct")

    def stable() -> int:
        return PolicyTable.from_redis(redis_client.hgetall(keys.policy)).stable

    async def scenario(client: Any) -> list[Any]:
        a, b = reloader(valkey.url, client, "r-a"), reloader(valkey.url, client, "r-b")
        seen = []
        for rl in (a, b):
            await rl.beat()
            await versions.save_state(client, keys, rl.replica, st(1))
        await versions.save_state(client, keys, "r-a", st(2))
        seen.append((await a._raise_everywhere(once=True), stable()))  # r-b lacks v2: stable stays v1
        beating = asyncio.create_task(a.heartbeat())  # r-a keeps beating, r-b stops: its TTL is 1 s
        try:
            await asyncio.to_thread(wait_for, lambda: versions.live_replicas(redis_client, keys) == ["r-a"], 5, 0.05)
            seen.append((await a._raise_everywhere(once=True), stable()))  # the live set has v2: raised
            await client.hset(keys.policy, "stable", "1")  # lowered by hand: v2 is not raised again by this life
            seen.append((await a._raise_everywhere(once=True), stable()))
        finally:
            beating.cancel()  # as Reloader.run does: the heartbeat stops before the replica leaves
            with contextlib.suppress(asyncio.CancelledError):
                await beating
        await a.leave()
        await b.beat()
        seen.append(versions.live_replicas(redis_client, keys))
        return seen

    versions.report(redis_client, keys, "r-0", ttl=0.001)  # a replica long gone (nothing pins, nothing holds back)
    redis_client.hset(keys.policy, mapping=PolicyTable(stable=1).to_redis())
    assert run_async(valkey.url, scenario) == [(False, 1), (True, 2), (False, 1), ["r-b"]]


def test_a_replica_whose_engine_is_down_does_not_beat(valkey, redis_client) -> None:
    keys = Keys("direct")

    async def scenario(client: Any) -> list[str]:
        rl = reloader(valkey.url, client, "r-down")
        rl.engine_seen_up = False
        await rl.beat()
        return versions.live_replicas(redis_client, keys)

    assert run_async(valkey.url, scenario) == []


# --- ACL: the reloader writes its own state, trainer/rollout/operator read the aggregate -----------------------------
@pytest.fixture
def acl_valkey(tmp_path: Path) -> Iterator[EmbeddedValkey]:
    server = EmbeddedValkey(tmp_path / "valkey", users=RedisUsers("acl", ensure_users_file(tmp_path / "u.yaml")))
    server.start()
    try:
        yield server
    finally:
        server.stop()


def test_each_component_touches_replica_state_within_its_rights(acl_valkey) -> None:
    keys = Keys("acl")
    clients = {u: redis.Redis.from_url(acl_valkey.url_for(u)) for u in ("reloader", "trainer", "rollout", "operator")}
    try:
        versions.report(clients["reloader"], keys, "r-a", [st(1), st(2)], ttl=LONG)
        run_async(acl_valkey.url_for("reloader"), lambda c: versions.save_state(c, keys, "r-a", st(3, "loading")))
        for user in ("trainer", "rollout", "operator"):
            table = versions.read(clients[user], keys)
            assert table.loaded() == {1, 2} and table.in_use() == {1, 2, 3}, user
        assert holds.read(clients["trainer"], keys) == set()
        for user in ("trainer", "rollout", "operator"):
            with pytest.raises(redis.exceptions.NoPermissionError):
                versions.report(clients[user], keys, "r-f", [st(9)])
            with pytest.raises(redis.exceptions.NoPermissionError):
                clients[user].zadd(keys.replicas, {"r-f": 9e12})
        with pytest.raises(redis.exceptions.NoPermissionError):  # the reloader: this job's keys only
            versions.report(clients["reloader"], Keys("another"), "r-a", [st(9)])
        run_async(acl_valkey.url_for("reloader"), lambda c: versions.leave_async(c, keys, "r-a"))
        assert versions.read(clients["trainer"], keys).replicas == {}
    finally:
        for c in clients.values():
            c.close()
