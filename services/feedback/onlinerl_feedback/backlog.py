"""Background view of the samples backlog, so the hot path checks a number instead of paying a round trip.

The trainer XDELs samples once a checkpoint holds them, so ``XLEN samples`` is the unconsumed backlog. It is
refreshed every ``interval`` seconds; a bound crossed between two refreshes is caught at the next one, which only
lets ``interval x rate`` extra events in (bounded, and nothing is ever dropped: the stream is not trimmed).
"""

from __future__ import annotations

import asyncio
import logging

from redis.asyncio import Redis
from redis.exceptions import RedisError, ResponseError

from onlinerl.aio import cancel_and_wait
from onlinerl.keys import SAMPLES_GROUP, Keys

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
            self.backlog = int(await self._client.xlen(self._keys.samples))
            self.lag = await self._group_lag()
        except RedisError as exc:
            log.debug("backlog refresh failed: %s", exc)
            return
        self._metrics.backlog.set(self.backlog)
        self._metrics.consumer_lag.set(self.lag)

    async def _group_lag(self) -> int:
        """Entries never delivered to group ``trainers``; the whole stream while the group does not exist yet."""
        try:
            groups = await self._client.xinfo_groups(self._keys.samples)
        except ResponseError:  # no such key: nothing to consume
            return 0
        for g in groups:
            name = g.get("name") or g.get(b"name")
            if (name.decode() if isinstance(name, bytes) else name) == SAMPLES_GROUP:
                lag = g.get("lag", g.get(b"lag"))
                return int(lag) if lag is not None else self.backlog
        return self.backlog

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
