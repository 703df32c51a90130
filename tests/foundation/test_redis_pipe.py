"""The pipelined connection both services write through, against a real valkey: order, error isolation, failure."""

from __future__ import annotations

import asyncio
import time

import pytest
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from onlinerl.redis_pipe import PipelinedConnection, RedisUnavailable, pack_command


def test_pack_command_is_resp_bulk_strings() -> None:
    assert pack_command(("SET", b"k\r\n", 12)) == b"*3\r\n$3\r\nSET\r\n$3\r\nk\r\n\r\n$2\r\n12\r\n"
    assert pack_command(("ECHO", "é")) == b"*2\r\n$4\r\nECHO\r\n$2\r\n\xc3\xa9\r\n"


async def test_concurrent_senders_get_their_own_replies_in_write_order(valkey) -> None:
    client = Redis.from_url(valkey.url)
    pipe = PipelinedConnection(client)
    try:
        replies = await asyncio.gather(*(pipe.call("INCR", "n") for _ in range(200)))
        assert sorted(replies) == list(range(1, 201))
        batch = await pipe.send([("SET", "s", "x"), ("LPUSH", "s", "y"), ("GET", "s")])
        assert await batch[0] == b"OK"  # raw replies: no redis-py response callbacks
        with pytest.raises(ResponseError, match="WRONGTYPE"):  # an error reply fails its own command only
            await batch[1]
        assert await batch[2] == b"x"
    finally:
        await pipe.close()
        await client.aclose()


async def test_a_dead_server_fails_what_is_waiting_and_the_next_send_reconnects(valkey) -> None:
    client = Redis.from_url(valkey.url, socket_connect_timeout=0.5, socket_timeout=5)
    pipe = PipelinedConnection(client)
    try:
        (blocked,) = await pipe.send([("BLPOP", "never", "30")])  # waits server-side until the server dies
        valkey.kill()
        started = time.monotonic()
        with pytest.raises(RedisUnavailable):
            await blocked
        assert time.monotonic() - started < 3  # the lost connection is noticed, not waited out
        with pytest.raises(RedisUnavailable):
            await pipe.call("PING")
        valkey.start()
        assert await pipe.call("PING") == b"PONG"
    finally:
        await pipe.close()
        await client.aclose()


async def test_a_write_returns_within_the_loops_turn_and_a_server_that_stops_reading_times_it_out(valkey) -> None:
    """A write is handed to the socket without yielding to the event loop (redis-py's own send makes a Task per
    write under a socket timeout: a loop turn, 356 µs per rollout record in vLLM's busy loop, issue 40). When the
    server stops reading, writes pile up in the socket buffer, and past DRAIN_ABOVE a write waits for it, bounded by
    the socket timeout: RedisUnavailable, never a send that hangs."""
    import os
    import signal

    client = Redis.from_url(valkey.url, socket_timeout=1)
    pipe = PipelinedConnection(client)
    try:
        assert await pipe.call("PING") == b"PONG"
        ran: list[str] = []
        loop = asyncio.get_running_loop()
        loop.call_soon(ran.append, "other task")  # runs at the loop's next turn
        (ack,) = await pipe.send([("SET", "k", "v")])
        assert ran == []  # the send did not give the loop a turn
        assert await ack == b"OK"
        os.kill(valkey.process.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(RedisUnavailable, match="did not read"):
                for _ in range(4096):  # up to 256 MiB: far beyond any socket buffer
                    await pipe.send([("SET", "big", b"x" * (64 << 10))])
            assert time.monotonic() - started < 10
        finally:
            os.kill(valkey.process.pid, signal.SIGCONT)
        assert await pipe.call("PING") == b"PONG"  # the next send reconnects
    finally:
        await pipe.close()
        await client.aclose()
