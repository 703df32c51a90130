"""Background tasks stop when told, even when a library swallows the first cancellation (onlinerl/aio.py)."""

from __future__ import annotations

import asyncio
import time

import pytest

from onlinerl.aio import Periodic, cancel_and_wait


async def _swallowing_library_call() -> None:
    """Like a client call that catches CancelledError to clean up and does not re-raise it."""
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        pass


def test_a_periodic_loop_whose_step_swallows_the_cancel_still_stops() -> None:
    """The feedback service's hang on SIGTERM: the monitor's cancel landed inside its step, the step returned
    normally, the loop slept and stepped again, and ``close`` waited forever. Now it stops within a few re-cancels."""
    steps = 0

    async def step() -> None:
        nonlocal steps
        steps += 1
        if steps == 1:
            await _swallowing_library_call()  # the cancel lands here, and is swallowed

    async def main() -> float:
        loop = Periodic(step, 0.05, "swallows")
        loop.start()
        while steps == 0:
            await asyncio.sleep(0.001)
        t0 = time.monotonic()
        await asyncio.wait_for(loop.close(), 5)
        return time.monotonic() - t0

    took = asyncio.run(main())
    assert took < 1.0, took
    assert steps >= 2  # the first cancel was swallowed: the loop really did go on, and was stopped anyway


def test_cancel_and_wait_still_raises_what_the_task_raised() -> None:
    async def fails() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            raise ValueError("cleanup failed") from None

    async def main() -> None:
        task = asyncio.create_task(fails())
        await asyncio.sleep(0)
        await cancel_and_wait(task)

    with pytest.raises(ValueError, match="cleanup failed"):
        asyncio.run(main())


def test_cancel_and_wait_of_nothing_or_a_finished_task() -> None:
    async def main() -> None:
        await cancel_and_wait(None)
        task = asyncio.create_task(asyncio.sleep(0))
        await task
        await cancel_and_wait(task)

    asyncio.run(main())
