"""The audit stream's retention (``privacy.retention.auditSeconds``), enforced by its main writer, the feedback
service: once a minute, entries older than the retention are trimmed (onlinerl/dataplane/audit.py
``trim_expired``). With several feedback workers or replicas each runs it; the trim is idempotent (an entry past the
cut-off is gone whoever trims first), and a check that finds nothing due writes nothing."""

from __future__ import annotations

import logging
import time

from redis.asyncio import Redis
from redis.exceptions import RedisError

from onlinerl.aio import Periodic
from onlinerl.dataplane import audit
from onlinerl.keys import Keys
from onlinerl.schemas import AuditEntry

log = logging.getLogger(__name__)

RETENTION = "retention"  # outcome of the marker entry a trim appends


def marker(retention_seconds: int, now: float) -> bytes:
    """The audit entry a trim appends: that retention ran, and its bound (no tenant, no text)."""
    return AuditEntry(
        event_id=f"retention:{int(now)}",
        tenant="-",
        outcome=RETENTION,
        reason=f"audit entries older than privacy.retention.auditSeconds={retention_seconds} trimmed",
        received_at=now,
    ).to_json()


class AuditRetention:
    def __init__(self, client: Redis, keys: Keys, retention_seconds: int, interval: float = 60.0) -> None:
        self._client = client
        self._keys = keys
        self.retention_seconds = retention_seconds
        self._loop = Periodic(self._check, interval, "audit-retention")

    async def enforce(self, now: float | None = None) -> int:
        """One check: trims what is older than the retention; the number of entries trimmed."""
        now = time.time() if now is None else now
        cutoff_ms = int((now - self.retention_seconds) * 1000)
        trimmed = await audit.trim_expired(self._client, self._keys, cutoff_ms, marker(self.retention_seconds, now))
        if trimmed:
            log.info("audit retention: trimmed %d entries older than %d s", trimmed, self.retention_seconds)
        return trimmed

    async def _check(self) -> None:
        try:
            await self.enforce()
        except RedisError as exc:
            log.debug("audit retention check failed: %s", exc)

    def start(self) -> None:
        self._loop.start()

    async def close(self) -> None:
        await self._loop.close()
