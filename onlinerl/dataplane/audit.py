"""The audit stream (``audit``): feedback events that are not trained on (unmatched, altered, rejected, duplicates,
over a limit, silences), capped at ``AUDIT_MAXLEN`` entries. Writers: the feedback service (in its append script,
``samples.APPEND``, or with ``append`` for a duplicate; its silence sweeper). Readers: operators of the product.
"""

from __future__ import annotations

from typing import Any

import redis

from onlinerl.dataplane.codec import DATA, entries, text
from onlinerl.dataplane.scripts import Caller
from onlinerl.keys import Keys

AUDIT_MAXLEN = 100_000


async def append(conn: Caller, keys: Keys, entry: bytes | str) -> str:
    """One capped XADD (a duplicate's audit entry: a round trip only for the duplicate itself); its entry id."""
    return text(await conn.call("XADD", keys.audit, "MAXLEN", "~", AUDIT_MAXLEN, "*", DATA, entry))


def read(client: redis.Redis, keys: Keys, count: int | None = None, start: str = "-") -> list[tuple[str, Any]]:
    """(id, data) of the audit entries from ``start`` on, oldest first."""
    return [(i, f.get(DATA, b"")) for i, f in entries(client.xrange(keys.audit, min=start, count=count))]
