"""Small asyncio helpers shared by the services."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

RECANCEL_SECONDS = 0.1


async def cancel_and_wait(task: asyncio.Task | None) -> None:
    """Cancel a background task and wait until it has stopped (its cancellation is expected, not an error).

    The task is cancelled again every ``RECANCEL_SECONDS`` until it stops. Why: a cancellation that lands inside a
    library call can be swallowed. A feedback service then hung on SIGTERM until it was killed: its backlog
    monitor's cancel landed inside a redis-py call, the loop went on to its next tick, and ``await task`` never
    returned (about once in seven runs on a loaded box; the mechanism: tests/foundation/test_aio.py). A second cancel
    lands in the loop's sleep."""
    if task is None:
        return
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=RECANCEL_SECONDS)
    with contextlib.suppress(asyncio.CancelledError):
        await task


class Periodic:
    """``step()`` every ``interval`` seconds in one background task, for the services' monitors and keepers.
    ``step`` handles its own expected errors (a Redis hiccup must not end the loop); ``start`` is idempotent and
    ``close`` waits until the task has stopped."""

    def __init__(self, step: Callable[[], Awaitable[object]], interval: float, name: str) -> None:
        self._step = step
        self._interval = interval
        self._name = name
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        while True:
            await self._step()
            await asyncio.sleep(self._interval)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=self._name)

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
