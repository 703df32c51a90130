"""``Script``: every way to run a Lua script runs the same source, and survives an emptied script cache."""

from __future__ import annotations

import asyncio

import pytest
import redis
import redis.asyncio as aioredis

from onlinerl.dataplane.scripts import Script
from onlinerl.redis_pipe import PipelinedConnection

# Appends ARGV[1] to KEYS[1] and returns the new length: a repeated run is visible in the figure.
APPEND = Script("return redis.call('APPEND', KEYS[1], ARGV[1])")
FAILS = Script("return redis.error_reply('BAD input')")


def test_sha1_is_the_one_redis_computes(redis_client: redis.Redis) -> None:
    assert redis_client.script_load(APPEND.source) == APPEND.sha1


def test_sync_runs_once_even_after_the_cache_is_flushed(redis_client: redis.Redis) -> None:
    redis_client.script_flush()  # as after a Redis restart: EVALSHA answers NOSCRIPT, the script did not run
    assert APPEND.run(redis_client, ["k"], ["ab"]) == 2
    assert APPEND.run(redis_client, ["k"], ["cd"]) == 4  # second call: EVALSHA hits the cache
    assert redis_client.get("k") == b"abcd"  # each call appended exactly once (the NOSCRIPT retry did not double)
    with pytest.raises(redis.ResponseError, match="BAD input"):
        FAILS.run(redis_client, [])


def test_async_and_piped_run_once_after_a_flush(empty_valkey, redis_client: redis.Redis) -> None:
    async def main() -> tuple[int, int, int]:
        client = aioredis.from_url(empty_valkey.url)
        conn = PipelinedConnection(client)
        try:
            await client.script_flush()
            a = await APPEND.run_async(client, ["k"], ["x"])
            await client.script_flush()
            b = await APPEND.run_piped(conn, ["k"], ["y"])
            c = await APPEND.run_piped(conn, ["k"], ["z"])
            with pytest.raises(redis.ResponseError, match="BAD input"):
                await FAILS.run_piped(conn, [])
            return a, b, c
        finally:
            await conn.close()
            await client.aclose()

    assert asyncio.run(main()) == (1, 2, 3)
    assert redis_client.get("k") == b"xyz"


def test_bare_commands_go_through_a_pipeline(redis_client: redis.Redis) -> None:
    redis_client.script_flush()
    pipe = redis_client.pipeline(transaction=False)
    pipe.execute_command(*APPEND.eval_command(["k"], ["q"]))
    pipe.execute_command(*APPEND.evalsha_command(["k"], ["r"]))  # cached by the EVAL just before it
    assert pipe.execute() == [1, 2]
