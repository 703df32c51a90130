"""Background view of the samples backlog, so the hot path checks a number instead of paying a round trip.

The trainer XDELs samples once a checkpoint holds them, so ``XLEN samples`` is the unconsumed backlog. It is
refreshed every ``interval`` seconds; a bound crossed between two refreshes is caught at the next one, which only
lets ``interval x rate`` extra events in (bounded, and nothing is ever dropped: the stream is not trimmed).
"""

from __future__ import annotations

import asyncio
import logging

from redis.asyncio import Redis
from redis.exceptions import RedisError

from onlinerl.aio import cancel_and_wait
from onlinerl.dataplane import samples
from onlinerl.keys import Keys

from .metrics import FeedbackMetrics

log = logging.getLogger(__name__)


class BacklogMonitor:
    def __init__(self, client: Redis, keys: Keys, metrics: FeedbackMetrics, interval: float = 0.25) -> None:
        self._client = client
        self._keys = keys
        self._metrics = metrics
        self._interval = interval
        self._task: asyncio.Task | None = None
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

    async def _run(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self._interval)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="backlog-monitor")

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
