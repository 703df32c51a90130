"""Version holds (``holds`` hash): an evaluation asks serving to keep the versions it compares loaded until it is done.

Without a hold, a trainer that keeps publishing makes the reloader retire an older version in the middle of its
evaluation (``serving.keepVersions``), and the pinned requests fail with 409. A hold is a field of the hash
``Keys.holds``: ``version -> expiry (unix seconds)``. It expires by itself, so a crashed evaluation cannot hold a
version forever; the evaluation deletes its holds when it ends. Writers: `onlinerl eval` and the rollout gate's
evaluation; reader: the reloader.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

import redis

from onlinerl.keys import Keys

DEFAULT_HOLD_SECONDS = 1800.0


def active_holds(raw: Mapping[bytes | str, bytes | str], now: float) -> set[int]:
    """Versions held at ``now`` from the hash's raw fields (malformed fields are ignored, never fatal)."""
    held: set[int] = set()
    for field, value in raw.items():
        try:
            version, expiry = int(field), float(value)
        except (TypeError, ValueError):
            continue
        if expiry > now:
            held.add(version)
    return held


async def read_async(client: Any, keys: Keys, now: float | None = None) -> set[int]:
    """Versions held now (the reloader keeps them loaded)."""
    return active_holds(await client.hgetall(keys.holds), time.time() if now is None else now)


def hold(client: redis.Redis, keys: Keys, versions: Iterable[int], seconds: float = DEFAULT_HOLD_SECONDS) -> list[int]:
    """Hold ``versions`` (the base model, 0, is always loaded and needs none); returns the versions held."""
    held = sorted({v for v in versions if v > 0})
    if held:
        client.hset(keys.holds, mapping={str(v): f"{time.time() + seconds:.3f}" for v in held})
    return held


def release(client: redis.Redis, keys: Keys, versions: Iterable[int]) -> None:
    fields = [str(v) for v in versions]
    if fields:
        client.hdel(keys.holds, *fields)
