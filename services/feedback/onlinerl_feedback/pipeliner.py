"""Group commit for Redis: coalesce the commands of concurrent requests into one pipelined write.

Under load, each request would otherwise pay its own round trip (and, with ``appendfsync always``, its own fsync
wait). Here a single flusher sends whatever accumulated while the previous batch was in flight, so the number of
round trips (and fsyncs) grows with time, not with request rate. Each caller still gets its own reply (or error),
and only after Redis answered it. The wire work is ``onlinerl.redis_pipe`` (raw RESP, no redis-py Pipeline).
"""

from __future__ import annotations

import asyncio
from typing import Any

from redis.asyncio import Redis

from onlinerl.aio import cancel_and_wait
from onlinerl.redis_pipe import PipelinedConnection, RedisUnavailable

__all__ = ["Pipeliner", "RedisUnavailable"]


class Pipeliner:
    """Batches commands; at most ``max_batch`` per write, one batch in flight, at most ``max_pending`` waiting.
    Replies come back as the connection's protocol sends them (HGETALL: a dict under RESP3, a flat list under RESP2).
    """

    def __init__(self, client: Redis, max_batch: int = 256, max_pending: int = 4096) -> None:
        self._conn = PipelinedConnection(client)
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
        await cancel_and_wait(self._task)
        self._task = None
        await self._conn.close()
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
            replies = await self._conn.send([args for args, _ in batch])
        except RedisUnavailable as err:  # nothing of this batch is acknowledged
            for _, caller in batch:
                if not caller.done():
                    caller.set_exception(err)
            return
        await asyncio.wait(replies)  # the next batch forms meanwhile: that is the group commit
        for (_, caller), reply in zip(batch, replies, strict=True):
            if caller.done():  # the client went away; Redis still did the work (dedupe makes a retry safe)
                continue
            if reply.exception() is not None:
                caller.set_exception(reply.exception())
            else:
                caller.set_result(reply.result())
