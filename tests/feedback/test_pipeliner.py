"""Group commit on a real valkey: calls share round trips, each gets its own reply, overload is refused."""

from __future__ import annotations

import asyncio

import pytest
from redis.asyncio import Redis

from onlinerl_feedback.pipeliner import Pipeliner, RedisUnavailable


async def test_concurrent_calls_share_round_trips_and_get_their_own_replies(valkey):
    client = Redis.from_url(valkey.url)
    p = Pipeliner(client)
    p.start()
    try:
        ids = await asyncio.gather(*(p.call("XADD", "s", "*", "n", str(i)) for i in range(200)))
        assert len(set(ids)) == 200
        assert p.commands == 200 and p.batches < 20  # coalesced, not one round trip each
        entries = await client.xrange("s")
        assert [e[0] for e in entries] == ids and [e[1][b"n"] for e in entries] == [str(i).encode() for i in range(200)]
        with pytest.raises(Exception, match="WRONGTYPE"):  # a command error reaches only its caller
            await asyncio.gather(p.call("HGETALL", "s"))
    finally:
        await p.close()
        await client.aclose()


async def test_overload_and_unreachable_redis_raise_redis_unavailable(valkey):
    client = Redis.from_url(valkey.url, socket_connect_timeout=0.5)
    p = Pipeliner(client, max_pending=5)
    p.start()
    try:
        results = await asyncio.gather(*(p.call("PING") for _ in range(8)), return_exceptions=True)
        assert sum(isinstance(r, RedisUnavailable) for r in results) == 3  # refused at once, not queued
        valkey.kill()
        with pytest.raises(RedisUnavailable):
            await p.call("PING")
    finally:
        await p.close()
        await client.aclose()
