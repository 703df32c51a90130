"""Arm statistics (``stats:v{N}:{arm}`` hashes): counters per (policy version, arm).

Writers: the gateway counts ``served`` (in its record script, ``rollouts``), feedback counts the rest (in its append
script, ``samples.APPEND``: a counter moves only with the event that rated). Readers: the rollout controller (the
canary's figures), the operator and `onlinerl status`. Field names are ``records.COUNTER_FIELDS``.
"""

from __future__ import annotations

from typing import Any

import redis

from onlinerl.arms import Arm
from onlinerl.dataplane.codec import str_map, text
from onlinerl.keys import Keys
from onlinerl.rollout.records import ArmStats


def read(client: redis.Redis, keys: Keys, version: int, arm: Arm) -> ArmStats:
    return ArmStats.from_mapping(client.hgetall(keys.stats(version, arm)))


async def read_async(client: Any, keys: Keys, version: int, arm: Arm) -> ArmStats:
    return ArmStats.from_mapping(await client.hgetall(keys.stats(version, arm)))


def read_all(client: redis.Redis, keys: Keys) -> dict[tuple[int, str], dict[str, int]]:
    """Every (version, arm)'s counters (SCAN: for `onlinerl status`, not for a hot path)."""
    out: dict[tuple[int, str], dict[str, int]] = {}
    for key in client.scan_iter(match=f"{keys.prefix}stats:v*", count=500):
        version, arm = text(key).rsplit(":", 2)[-2:]
        try:
            out[(int(version[1:]), arm)] = {f: int(float(x)) for f, x in str_map(client.hgetall(key)).items()}
        except ValueError:
            continue
    return out
