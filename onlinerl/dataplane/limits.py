"""Contribution limits and quarantine (``contrib:*`` counters, ``ustats:*`` hashes, ``quarantine:*`` marks).

The feedback append script (``samples.APPEND``) counts, tests and quarantines in the same atomic step as the append,
so no burst of concurrent events slips past a limit; this module holds the rest: an admin's release of a user.
"""

from __future__ import annotations

from typing import Any

from onlinerl.keys import Keys


async def release(client: Any, keys: Keys, tenant: str, user: str) -> bool:
    """Drop a user's quarantine mark and counters (an admin's decision); True if the user was quarantined."""
    was = await client.exists(keys.quarantine(tenant, user))
    await client.delete(keys.quarantine(tenant, user), keys.user_stats(tenant, user))
    return bool(was)
