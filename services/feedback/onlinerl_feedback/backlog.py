"""Background view of the samples backlog, so the hot path checks a number instead of paying a round trip.

The trainer XDELs samples once a checkpoint holds them, so ``XLEN samples`` is the unconsumed backlog. It is
refreshed every ``interval`` seconds; a bound crossed between two refreshes is caught at the next one, which only
lets ``interval x rate`` extra events in (bounded, and nothing is ever dropped: the stream is not trimmed).
"""

from __future__ import annotations

import logging

from redis.asyncio import Redis
from redis.exceptions import RedisError

from onlinerl.aio import Periodic
from onlinerl.dataplane import samples
from onlinerl.keys import Keys

from .metrics import FeedbackMetrics

log = logging.getLogger(__name__)


class BacklogMonitor:
    def __init__(self, client: Redis, keys: Keys, metrics: FeedbackMetrics, interval: float = 0.25) -> None:
        self._client = client
        self._keys = keys
        self._metrics = metrics
        self._loop = Periodic(self.refresh, interval, "backlog-monitor")
        self.backlog = 0
        self.lag = 0

    async def refresh(self) -> None:
        """One XLEN + XINFO GROUPS; keeps the last figures when Redis does not answer."""
        try:
            self.backlog, self.lag = await samples.backlog(self._client, self._keys)
        except RedisError as exc:
            log.debug("backlog refresh failed: %s", exc)
            return
        self._metrics.backlog.set(self.backlog)
        self._metrics.consumer_lag.set(self.lag)

    def start(self) -> None:
        self._loop.start()

    async def close(self) -> None:
        await self._loop.close()
