"""Each component user refused outside its job, written as the attack it stops (issue 35), on a real valkey started
with the generated aclfile: ``ACL DRYRUN`` for every command, and real clients running the product's own scripts.

- A compromised gateway (the internet-facing process) cannot write the policy table, whatever the job's strategy:
  not with HSET, not with the reloader's own raise script, not by deleting it.
- A compromised feedback service can add samples, never delete, trim, expire or overwrite the stream (which would
  take the trainer's group and its pending entries with it), not even from a script.
- The reloader, which applies ``direct``, may raise stable; it cannot touch samples or trim the audit stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import redis
import redis.asyncio as aioredis

from onlinerl.config import OnlineRLConfig
from onlinerl.dataplane import acl, policy
from onlinerl.dataplane.contract import Component
from onlinerl.keys import Keys
from onlinerl.valkey import EmbeddedValkey, RedisUsers
from tests.dataplane.test_acl import dryrun

JOB = "lp-demo"
K = Keys(JOB)
STRATEGIES = ("direct", "canary", "bluegreen")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedValkey]:
    vk = EmbeddedValkey(tmp_path_factory.mktemp("lp") / "valkey", users=RedisUsers(JOB, acl.new_passwords()))
    vk.start()
    try:
        yield vk
    finally:
        vk.stop()


@pytest.fixture
def admin(server: EmbeddedValkey) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(server.url, decode_responses=True)
    client.flushall()
    client.acl_log_reset()
    client.hset(K.policy, mapping={"stable": "1", "updated_at": "0"})
    client.xgroup_create(K.samples, "trainers", id="0", mkstream=True)
    client.xadd(K.samples, {"data": "{}"})
    client.xadd(K.audit, {"data": "{}"})
    yield client
    client.close()


def client_of(server: EmbeddedValkey, component: Component) -> redis.Redis:
    return redis.Redis.from_url(server.url_for(component), socket_timeout=5)


def raise_stable_as(server: EmbeddedValkey, component: Component, version: int) -> int:
    """The reloader's real ``direct`` raise (``policy.RAISE_STABLE``), run by ``component``'s user."""

    async def go() -> int:
        client = aioredis.from_url(server.url_for(component))
        try:
            return await policy.raise_stable(client, K, version)
        finally:
            await client.aclose()

    return asyncio.run(go())


POLICY_WRITES = [
    ("HSET", K.policy, "stable", "9"),
    ("HSET", K.policy, "candidate", "9", "canary_share", "1.0"),
    ("HDEL", K.policy, "hold"),
    ("DEL", K.policy),
    ("EXPIRE", K.policy, "1"),
    ("SET", K.policy, "x"),
    ("EVAL", "return redis.call('HSET', KEYS[1], 'stable', '9')", "1", K.policy),
]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_gateway_cannot_write_the_policy_table_under_any_strategy(
    server: EmbeddedValkey, admin: redis.Redis, strategy: str
) -> None:
    """Users are generated per job, never per strategy: the job's rules are the same under each (so the refusal is),
    and on the server every way to change the table is refused to ``gateway`` while it still reads it."""
    cfg = OnlineRLConfig.model_validate({"job": JOB, "rollout": {"strategy": strategy}})
    assert acl.aclfile_template(cfg.job) == acl.aclfile_template(JOB)
    for command in POLICY_WRITES:
        reason = dryrun(admin, "gateway", *command)
        assert reason != "OK" and ("permissions" in reason or "NOPERM" in reason), (command, reason)
    assert dryrun(admin, "gateway", "HGETALL", K.policy) == "OK"  # it routes by it
    with pytest.raises(redis.exceptions.NoPermissionError):
        raise_stable_as(server, Component.GATEWAY, 9)
    gw = client_of(server, Component.GATEWAY)
    try:
        with pytest.raises(redis.exceptions.NoPermissionError):
            gw.hset(K.policy, "stable", "9")
        with pytest.raises(redis.exceptions.NoPermissionError):  # a script runs with the caller's rights
            gw.eval("return redis.call('HSET', KEYS[1], 'stable', '9')", 1, K.policy)
        assert gw.hget(K.policy, "stable") == b"1"
    finally:
        gw.close()
    assert admin.hget(K.policy, "stable") == "1"


def test_only_the_reloader_raises_stable_and_only_within_the_table(server: EmbeddedValkey, admin: redis.Redis) -> None:
    """The component that applies ``direct`` may raise stable (through its one script), and nothing else may."""
    assert raise_stable_as(server, Component.RELOADER, 2) == policy.RAISED
    assert admin.hget(K.policy, "stable") == "2"
    for component in (Component.GATEWAY, Component.FEEDBACK, Component.TRAINER):
        with pytest.raises(redis.exceptions.NoPermissionError):
            raise_stable_as(server, component, 3)
    assert admin.hget(K.policy, "stable") == "2"


FEEDBACK_DESTROYS = [
    ("DEL", K.samples),
    ("UNLINK", K.samples),
    ("XTRIM", K.samples, "MAXLEN", "0"),
    ("XDEL", K.samples, "0-1"),
    ("EXPIRE", K.samples, "1"),
    ("PEXPIRE", K.samples, "1"),
    ("SET", K.samples, "x"),
    ("RENAME", K.samples, K.prefix + "seen:x"),
    ("XGROUP", "DESTROY", K.samples, "trainers"),
    ("XGROUP", "SETID", K.samples, "trainers", "$"),
    ("XACK", K.samples, "trainers", "0-1"),
]


def test_feedback_may_append_samples_but_never_delete_or_trim_them(server: EmbeddedValkey, admin: redis.Redis) -> None:
    for command in FEEDBACK_DESTROYS:
        assert dryrun(admin, "feedback", *command) != "OK", command
    assert dryrun(admin, "feedback", "XADD", K.samples, "*", "data", "{}") == "OK"
    assert dryrun(admin, "feedback", "XLEN", K.samples) == "OK"  # its backlog monitor
    assert dryrun(admin, "feedback", "XINFO", "GROUPS", K.samples) == "OK"
    fb = client_of(server, Component.FEEDBACK)
    try:
        assert fb.xadd(K.samples, {"data": "{}"})
        for script in (
            "return redis.call('DEL', KEYS[1])",
            "return redis.call('XTRIM', KEYS[1], 'MAXLEN', 0)",
            "return redis.call('EXPIRE', KEYS[1], 1)",
            "return redis.call('XDEL', KEYS[1], '0-1')",
        ):
            with pytest.raises(redis.exceptions.ResponseError, match=r"(?i)permission"):
                fb.eval(script, 1, K.samples)  # declared: the selector lets the EVAL in, not the DEL inside
        with pytest.raises(redis.exceptions.NoPermissionError):
            fb.delete(K.samples)
        with pytest.raises(redis.exceptions.NoPermissionError):
            fb.xtrim(K.samples, maxlen=0)
    finally:
        fb.close()
    assert admin.xlen(K.samples) == 2
    assert [g["name"] for g in admin.xinfo_groups(K.samples)] == ["trainers"]
    # the trainer, which knows what a checkpoint holds, may remove samples (positive control)
    assert dryrun(admin, "trainer", "XDEL", K.samples, "0-1") == "OK"
    assert dryrun(admin, "trainer", "XTRIM", K.samples, "MAXLEN", "0") == "OK"


def test_feedback_keeps_every_right_of_its_own_keys(server: EmbeddedValkey, admin: redis.Redis) -> None:
    """The append selector narrows the stream only: feedback's own families are still read+write (what its append
    script, limits release and silence sweeper do)."""
    for key in (K.prefix + "seen:t:1", K.prefix + "quarantine:t:u", K.prefix + "contrib:t:u:1"):
        assert dryrun(admin, "feedback", "SET", key, "1") == "OK"
        assert dryrun(admin, "feedback", "DEL", key) == "OK"


@pytest.mark.parametrize("user", ["feedback", "trainer", "reloader"])
def test_audit_writers_only_append(admin: redis.Redis, user: str) -> None:
    assert dryrun(admin, user, "XADD", K.audit, "MAXLEN", "~", "100000", "*", "data", "{}") == "OK"
    for command in (("DEL", K.audit), ("XTRIM", K.audit, "MAXLEN", "0"), ("XDEL", K.audit, "0-1")):
        assert dryrun(admin, user, *command) != "OK", (user, command)


def test_the_split_serving_users_hold_only_their_own_process_rights(admin: redis.Redis) -> None:
    """The gateway records what it served; the reloader loads and reports versions. Neither holds the other's."""
    gateway_only = [
        ("HSET", K.prefix + "rollouts:t:d", "r", "{}"),
        ("ZADD", K.prefix + "rollouts-index:t", "1", "m"),
        ("HINCRBY", K.stats(1, "stable"), "served", "1"),
    ]
    reloader_only = [
        ("HSET", K.replica_versions("r-0"), "1", "{}"),
        ("ZADD", K.replicas, "1", "r-0"),
        ("HSET", K.prefix + "reloader", "last_error", ""),
        ("XREAD", "STREAMS", K.checkpoints, "0"),
        ("XADD", K.audit, "*", "data", "{}"),
    ]
    for command in gateway_only:
        assert dryrun(admin, "gateway", *command) == "OK", command
        assert dryrun(admin, "reloader", *command) != "OK", command
    for command in reloader_only:
        assert dryrun(admin, "reloader", *command) == "OK", command
        assert dryrun(admin, "gateway", *command) != "OK", command
    assert "serving" not in {line.split()[1] for line in admin.execute_command("ACL", "LIST")}
