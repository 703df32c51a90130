"""Contribution limits and quarantine (``contrib:*`` counters, ``ustats:*`` hashes, ``quarantine:*`` marks).

The feedback append script (``samples.APPEND``) counts, tests and quarantines in the same atomic step as the append,
so no burst of concurrent events slips past a limit; this module holds the rest: an admin's release of a user.
"""

from __future__ import annotations

from typing import Any

import redis

from onlinerl.keys import Keys


async def release(client: Any, keys: Keys, tenant: str, user: str) -> bool:
    """Drop a user's quarantine mark and counters (an admin's decision); True if the user was quarantined."""
    was = await client.exists(keys.quarantine(tenant, user))
    await client.delete(keys.quarantine(tenant, user), keys.user_stats(tenant, user))
    return bool(was)


def forget(client: redis.Redis, keys: Keys, tenant: str, user: str | None) -> int:
    """`onlinerl forget` (admin): delete the contribution counters, statistics and quarantine mark of ``user`` (the
    key id, ``Identity.key_id``) in ``tenant``, or of every user of the tenant and its totals (``user`` None).
    Returns how many keys were deleted."""
    if user is None:
        patterns = [keys.contrib(tenant, "*", 0).rsplit(":", 2)[0] + ":*", keys.user_stats(tenant, "*")]
        patterns.append(keys.quarantine(tenant, "*"))
        totals = int(client.unlink(keys.user_stats(tenant)))
        return totals + sum(int(client.unlink(k)) for p in patterns for k in client.scan_iter(match=p, count=1000))
    patterns = [keys.contrib(tenant, user, 0).rsplit(":", 1)[0] + ":*"]
    deleted = int(client.unlink(keys.user_stats(tenant, user), keys.quarantine(tenant, user)))
    return deleted + sum(int(client.unlink(k)) for p in patterns for k in client.scan_iter(match=p, count=1000))
