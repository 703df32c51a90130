"""The audit stream (``audit``): feedback events that are not trained on (unmatched, altered, rejected, duplicates,
over a limit, silences), capped at ``AUDIT_MAXLEN`` entries. Writers: the feedback service (in its append script,
``samples.APPEND``, or with ``append`` for a duplicate; its silence sweeper), the trainer (``record``: acknowledged
samples it refuses, invalid or stale, so every acknowledged event is accounted for one by one, not only by a counter)
and serving's reloader (``record_async``: checkpoint announcements and folders it refuses).
Readers: operators of the product.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis
import redis.asyncio as aioredis

from onlinerl.dataplane.codec import DATA, entries, matching_entries, text
from onlinerl.dataplane.scripts import Caller
from onlinerl.keys import Keys

AUDIT_MAXLEN = 100_000


async def append(conn: Caller, keys: Keys, entry: bytes | str) -> str:
    """One capped XADD (a duplicate's audit entry: a round trip only for the duplicate itself); its entry id."""
    return text(await conn.call("XADD", keys.audit, "MAXLEN", "~", AUDIT_MAXLEN, "*", DATA, entry))


def record(client: redis.Redis, keys: Keys, entries: Sequence[bytes | str]) -> None:
    """Capped XADDs of ``entries`` in one round trip (the trainer's refused samples)."""
    if not entries:
        return
    pipe = client.pipeline(transaction=False)
    for entry in entries:
        pipe.xadd(keys.audit, {DATA: entry}, maxlen=AUDIT_MAXLEN, approximate=True)
    pipe.execute()


async def record_async(client: aioredis.Redis, keys: Keys, entries: Sequence[bytes | str]) -> None:
    """``record`` on an asyncio client (the reloader)."""
    if not entries:
        return
    pipe = client.pipeline(transaction=False)
    for entry in entries:
        pipe.xadd(keys.audit, {DATA: entry}, maxlen=AUDIT_MAXLEN, approximate=True)
    await pipe.execute()


def read(client: redis.Redis, keys: Keys, count: int | None = None, start: str = "-") -> list[tuple[str, Any]]:
    """(id, data) of the audit entries from ``start`` on, oldest first."""
    return [(i, f.get(DATA, b"")) for i, f in entries(client.xrange(keys.audit, min=start, count=count))]


# --- `onlinerl forget` (admin) ---------------------------------------------------------------------------------
def forget(client: redis.Redis, keys: Keys, tenant: str, user: str | None) -> int:
    """XDEL every audit entry of ``tenant`` (of ``user``: the entry's ``user_hash``, the sending key's or the served
    rollout's); the number deleted. Entries written before they carried a user are found only tenant-wide."""
    ids = matching_entries(
        client, keys.audit, lambda d: d.get("tenant") == tenant and (user is None or d.get("user_hash") == user)
    )
    deleted = 0
    for i in range(0, len(ids), 500):
        deleted += int(client.xdel(keys.audit, *ids[i : i + 500]))
    return deleted


# --- retention (privacy.retention.auditSeconds): the feedback service's keeper -----------------------------------
async def trim_expired(client: aioredis.Redis, keys: Keys, cutoff_ms: int, marker: bytes | str) -> int:
    """If the oldest audit entry is older than ``cutoff_ms`` (unix ms), trim every entry before it, exactly. Audit
    writers may only append (issue 35's ACLs: no XTRIM), so the trim is an XADD of ``marker`` (an entry saying that
    retention ran) with ``MINID``. Returns how many entries went (0: nothing was due, nothing added)."""
    oldest = await client.xrange(keys.audit, count=1)
    if not oldest or int(text(oldest[0][0]).partition("-")[0]) >= cutoff_ms:
        return 0
    before = int(await client.xlen(keys.audit))
    await client.xadd(keys.audit, {DATA: marker}, minid=str(cutoff_ms), approximate=False)
    return max(0, before + 1 - int(await client.xlen(keys.audit)))
