"""Version holds (``holds`` hash): an evaluation asks serving to keep the versions it compares loaded until it is done.

Without a hold, a trainer that keeps publishing makes the reloader retire an older version in the middle of its
evaluation (``serving.keepVersions``), and the pinned requests fail with 409. A hold is a field of the hash
``Keys.holds``: ``version[:holder] -> expiry (unix seconds)``. It expires by itself, so a crashed evaluation cannot
hold a version forever; the evaluation deletes its holds when it ends. Each holder has its own field (``5:gate``), so
the gate's release never drops the hold of an `onlinerl eval` comparing the same version. Writers: `onlinerl eval`
(admin) and the rollout gate's evaluation (rollout: its eval runs for minutes on CPU while the trainer keeps
publishing); readers: the reloader (keeps them loaded) and the trainer (never prunes them).
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
            name = field.decode() if isinstance(field, bytes) else str(field)
            version, expiry = int(name.split(":", 1)[0]), float(value)
        except (TypeError, ValueError, UnicodeDecodeError):
            continue
        if expiry > now:
            held.add(version)
    return held


async def read_async(client: Any, keys: Keys, now: float | None = None) -> set[int]:
    """Versions held now (the reloader keeps them loaded)."""
    return active_holds(await client.hgetall(keys.holds), time.time() if now is None else now)


def read(client: redis.Redis, keys: Keys, now: float | None = None) -> set[int]:
    """Versions held now (the trainer never prunes them)."""
    return active_holds(client.hgetall(keys.holds), time.time() if now is None else now)


def _field(version: int, holder: str) -> str:
    return f"{version}:{holder}" if holder else str(version)


def hold(
    client: redis.Redis,
    keys: Keys,
    versions: Iterable[int],
    seconds: float = DEFAULT_HOLD_SECONDS,
    holder: str = "",
) -> list[int]:
    """Hold ``versions`` for ``holder`` (the base model, 0, is always loaded and needs none); returns those held."""
    held = sorted({v for v in versions if v > 0})
    if held:
        client.hset(keys.holds, mapping={_field(v, holder): f"{time.time() + seconds:.3f}" for v in held})
    return held


def release(client: redis.Redis, keys: Keys, versions: Iterable[int], holder: str = "") -> None:
    """Release ``holder``'s holds on ``versions`` (another holder's hold on the same version stays)."""
    fields = [_field(v, holder) for v in versions]
    if fields:
        client.hdel(keys.holds, *fields)
