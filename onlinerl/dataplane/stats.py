"""Arm statistics (``stats:v{N}:{arm}`` hashes): counters per (policy version, arm).

Writers: the gateway counts ``served`` (in its record script, ``rollouts``), feedback counts the rest (in its append
script, ``samples.APPEND``: a counter moves only with the event that rated). During a canary both also count each
rollout under its served user in the canary's per-user ledger (``Keys.arm_users``), which ``read_users`` reads for the
rollout controller's per-user cap at a look, and ``count_users`` counts between looks. Readers: the rollout controller
(the canary's figures), the operator and `onlinerl status`. Field names are ``records.COUNTER_FIELDS``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis

from onlinerl.arms import Arm
from onlinerl.dataplane.codec import pairs, str_map, text
from onlinerl.keys import Keys
from onlinerl.rollout.records import COUNTER_FIELDS, ArmStats

COUNTERS = frozenset(COUNTER_FIELDS)


def read(client: redis.Redis, keys: Keys, version: int, arm: Arm) -> ArmStats:
    return ArmStats.from_mapping(client.hgetall(keys.stats(version, arm)))


async def read_async(client: Any, keys: Keys, version: int, arm: Arm) -> ArmStats:
    return ArmStats.from_mapping(await client.hgetall(keys.stats(version, arm)))


def read_users(client: redis.Redis, keys: Keys, version: int, arm: Arm, canary: int) -> dict[str, ArmStats]:
    """One canary's per-user ledger of an arm (``Keys.arm_users``): user -> that user's counters (empty when the
    gateway and feedback wrote none: traffic recorded before the ledgers existed).

    The controller reads both arms' ledgers at every look, and a ledger holds a field per user and counter: one
    pass over the reply's bytes that splits each field once, keeps only known counters (as ``ArmStats.from_mapping``:
    missing ones are 0, others ignored) and decodes each user once, not each field. 1.6x faster than decoding every
    field first, which was 1.45x faster than ``str_map`` then ``from_mapping`` per user (``bench/ledger_read.py``)."""
    return users_from_reply(client.hgetall(keys.arm_users(version, arm, canary)))


def count_users(client: redis.Redis, keys: Keys, ledgers: Sequence[tuple[int, Arm]], canary: int, at_most: int) -> int:
    """Distinct users in canary ``canary``'s per-user ledgers of ``ledgers`` ((version, arm) pairs; a user in two
    counts once), counted up to ``at_most``: the number, or ``at_most`` once that many are seen.

    For the controller's ticks between looks, which only ask whether a canary has fewer users than a look needs
    (few_users.py). ``read_users`` returns every user's counters: at 5,000 users that is 40,000 fields per arm on
    every tick, each HGETALL holding Redis (single-threaded) while the gateway's record writes wait. HSCAN stops as
    soon as ``at_most`` users are seen; a small ledger comes back whole in one call."""
    seen: set[bytes] = set()
    batch = max(100, at_most * len(COUNTER_FIELDS))
    for version, arm in ledgers:
        key = keys.arm_users(version, arm, canary)
        cursor: Any = 0
        while True:
            cursor, raw = client.hscan(key, cursor, count=batch)
            for field, _ in pairs(raw):
                user, sep, counter = (field if isinstance(field, bytes) else text(field).encode()).rpartition(b":")
                if sep and user and counter in _COUNTER_NAMES:  # the users ``users_from_reply`` would return
                    seen.add(user)
            if len(seen) >= at_most:
                return at_most
            if int(cursor) == 0:
                break
    return len(seen)


def seed_users(
    client: redis.Redis, keys: Keys, version: int, arm: Arm, canary: int, per_user: dict[str, ArmStats]
) -> None:
    """Write ``per_user`` into a per-user ledger, field for field as the gateway's record script and feedback's append
    script leave it after that traffic. For benchmarks on a throwaway valkey (``bench/canary_tick.py``), which need
    ledgers of thousands of users without serving them; no component calls it (the contract's writers stay the
    gateway and feedback)."""
    key = keys.arm_users(version, arm, canary)
    pipe = client.pipeline(transaction=False)
    for user, counts in per_user.items():
        fields = {f"{user}:{name}": value for name in COUNTER_FIELDS if (value := getattr(counts, name))}
        if fields:
            pipe.hset(key, mapping=fields)
    pipe.execute()


def users_from_reply(raw: Any) -> dict[str, ArmStats]:
    """A per-user ledger's HGETALL reply (a dict, or RESP2's flat list) -> user -> that user's counters."""
    per: dict[bytes, dict[str, int]] = {}
    for field, value in pairs(raw):
        user, sep, counter = (field if isinstance(field, bytes) else text(field).encode()).rpartition(b":")
        name = _COUNTER_NAMES.get(counter)
        if sep and user and name:
            per.setdefault(user, {})[name] = _count(value)
    return {user.decode(): ArmStats(**counts) for user, counts in per.items()}


_COUNTER_NAMES = {name.encode(): name for name in COUNTER_FIELDS}


def _count(value: Any) -> int:
    """A counter's reply value: an integer (HINCRBY writes them), else what ``ArmStats.from_mapping`` makes of it."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return int(float(value or 0))


def read_all(client: redis.Redis, keys: Keys) -> dict[tuple[int, str], dict[str, int]]:
    """Every (version, arm)'s counters of ``keys``' line (SCAN: for `onlinerl status`, not for a hot path; per-user
    ledgers skipped)."""
    out: dict[tuple[int, str], dict[str, int]] = {}
    for key in client.scan_iter(match=f"{keys.line_prefix}stats:v*", count=500):
        if ":users:" in text(key):
            continue
        version, arm = text(key).rsplit(":", 2)[-2:]
        try:
            out[(int(version[1:]), arm)] = {f: int(float(x)) for f, x in str_map(client.hgetall(key)).items()}
        except ValueError:
            continue
    return out


def forget_users(client: redis.Redis, keys: Keys, users: set[str]) -> int:
    """`onlinerl forget` (admin): delete ``users``' fields (``<user>:<counter>``) from every canary's per-user ledger
    (``Keys.arm_users``) on every policy line, the shared one and each project's (issue 39); the arm totals stay
    (they name no one). Returns the fields deleted."""
    deleted = 0
    if not users:
        return 0
    for pattern in ("stats:v*:users:*", "p:*:stats:v*:users:*"):
        for key in client.scan_iter(match=f"{keys.prefix}{pattern}", count=500):
            fields = [f for f, _ in str_map(client.hgetall(key)).items() if f.rpartition(":")[0] in users]
            if fields:
                deleted += int(client.hdel(key, *fields))
    return deleted
