"""Group commit for Redis: coalesce the commands of concurrent requests into one pipeline round trip.

Under load, each request would otherwise pay its own round trip (and, with ``appendfsync always``, its own fsync
wait). Here a single flusher sends whatever accumulated while the previous batch was in flight, so the number of
round trips (and fsyncs) grows with time, not with request rate. Each caller still gets its own reply (or error),
and only after Redis answered it.
"""

from __future__ import annotations

import asyncio
from typing import Any

from redis.asyncio import Redis


class RedisUnavailable(RuntimeError):
    """Redis did not answer (connection refused, reset or timed out): the request gets 503 + Retry-After."""


class Pipeliner:
    """Batches ``execute_command`` calls; at most ``max_batch`` commands per round trip, one batch in flight,
    at most ``max_pending`` waiting."""

    def __init__(self, client: Redis, max_batch: int = 256, max_pending: int = 4096) -> None:
        self._client = client
        self._max_batch = max_batch
        self._max_pending = max_pending
        self._pending: list[tuple[tuple[Any, ...], asyncio.Future]] = []
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.batches = 0
        self.commands = 0

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="redis-pipeliner")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        for _, fut in self._pending:
            if not fut.done():
                fut.set_exception(RedisUnavailable("feedback service is shutting down"))
        self._pending.clear()

    async def call(self, *args: Any) -> Any:
        """Run one command in the next batch; Redis errors come back as exceptions (RedisUnavailable for I/O)."""
        if len(self._pending) >= self._max_pending:
            # Redis is slower than the arrival rate: refuse now (503 + Retry-After) rather than queue without bound.
            raise RedisUnavailable(f"redis overloaded: {len(self._pending)} commands already waiting")
        fut = asyncio.get_running_loop().create_future()
        self._pending.append((args, fut))
        self._wakeup.set()
        return await fut

    async def _run(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._pending:
                batch = self._pending[: self._max_batch]
                del self._pending[: self._max_batch]
                await self._flush(batch)

    async def _flush(self, batch: list[tuple[tuple[Any, ...], asyncio.Future]]) -> None:
        self.batches += 1
        self.commands += len(batch)
        try:
            pipe = self._client.pipeline(transaction=False)
            for args, _ in batch:
                pipe.execute_command(*args)
            results = await pipe.execute(raise_on_error=False)
        except Exception as exc:  # any I/O failure fails the whole batch, none is acknowledged
            err = RedisUnavailable(f"redis unavailable: {type(exc).__name__}: {exc}")
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(err)
            return
        for (_, fut), result in zip(batch, results, strict=True):
            if fut.done():  # the client went away; Redis still did the work (dedupe makes a retry safe)
                continue
            if isinstance(result, Exception):
                fut.set_exception(result)
            else:
                fut.set_result(result)
