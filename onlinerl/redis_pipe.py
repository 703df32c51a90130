"""A pipelined Redis connection: commands are on the wire when ``send`` returns, replies are awaited separately.

Two services need exactly this and nothing more of a client:
- the gateway sends a rollout record's write before the client's ``[DONE]`` and awaits the fsync'd reply after it
  (Redis applies a command as soon as it reads it, so the record is readable before the client has the completion);
- the feedback service group-commits many requests' commands in one write.

Connections come from redis-py's pool (so AUTH, TLS and SELECT from the URL apply). Commands are packed here and
replies read back raw (redis-py's Pipeline object, packer and response callbacks cost about 20 us per command):
replies are as the connection's protocol sends them, e.g. HGETALL gives a dict (RESP3) or a flat list (RESP2).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ResponseError

from onlinerl.aio import cancel_and_wait


class RedisUnavailable(RuntimeError):
    """Redis did not answer (connection refused, reset or timed out); nothing sent since is known to be applied."""


def pack_command(args: Sequence[Any]) -> bytes:
    """One command as a RESP array of bulk strings (str is sent as UTF-8, numbers in decimal)."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        if isinstance(arg, str):
            arg = arg.encode()
        elif not isinstance(arg, bytes | bytearray | memoryview):
            arg = str(arg).encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(arg), arg))
    return b"".join(parts)


# Bytes queued in the socket's send buffer above which a write waits for it to drain (a Redis that stopped reading).
DRAIN_ABOVE = 1 << 20


async def _write(conn: AbstractConnection, data: bytes) -> None:
    """Hand ``data`` to the connection's socket without leaving the event loop's current turn.

    redis-py's ``send_packed_command`` wraps every write in ``asyncio.wait_for`` when the URL sets a socket timeout
    (ours always do: ``redis.socketTimeoutSeconds``); on Python 3.11 that is a new Task per write, so the caller waits
    for the loop's next turn. In vLLM's API server process (``serving.gatewayMode: inProcess``) that turn runs vLLM's
    own work first: 356 µs per rollout record, measured, on every completion's path. A write is synchronous (the
    transport sends at once or buffers); only a backed-up socket needs waiting on, with the timeout. Anything
    unusual (not connected yet, closing) takes redis-py's own path."""
    writer = getattr(conn, "_writer", None)
    transport = getattr(writer, "transport", None)
    if writer is None or transport is None or transport.is_closing():
        await conn.send_packed_command(data, check_health=False)
        return
    writer.write(data)
    if transport.get_write_buffer_size() > DRAIN_ABOVE:
        try:
            await asyncio.wait_for(writer.drain(), conn.socket_timeout)
        except TimeoutError:
            waited = conn.socket_timeout
            raise RedisUnavailable(f"redis did not read {DRAIN_ABOVE} queued bytes within {waited} s") from None


class PipelinedConnection:
    """One connection; ``send`` writes at once and returns one future per command, resolved in order by a reader
    task. An error reply fails only its own future; an I/O error fails every unanswered one (RedisUnavailable) and
    the next ``send`` reconnects."""

    def __init__(self, client: Redis) -> None:
        self._client = client
        self._conn: AbstractConnection | None = None
        self._connecting = asyncio.Lock()
        self._waiting: deque[asyncio.Future] = deque()
        self._replies_due = asyncio.Event()
        self._reader: asyncio.Task | None = None

    async def send(self, commands: Sequence[Sequence[Any]]) -> list[asyncio.Future]:
        """Write ``commands`` in one write; when this returns they have been handed to the socket, in call order."""
        conn = await self._connection()
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in commands]
        self._waiting.extend(futures)  # before the write: concurrent senders keep reply order = write order
        self._replies_due.set()
        try:
            await _write(conn, b"".join(pack_command(c) for c in commands))
        except BaseException as exc:
            await self._fail(conn, exc)
            if not isinstance(exc, Exception):
                raise
            raise RedisUnavailable(f"redis unavailable: {type(exc).__name__}: {exc}") from None
        return futures

    async def call(self, *args: Any) -> Any:
        """One command, one reply (error replies raise)."""
        (future,) = await self.send([args])
        return await future

    async def close(self) -> None:
        await cancel_and_wait(self._reader)
        self._reader = None
        if self._conn is not None:
            await self._fail(self._conn, RedisUnavailable("connection closed"))

    async def _connection(self) -> AbstractConnection:
        if self._conn is None:
            async with self._connecting:
                if self._conn is None:
                    try:
                        self._conn = await self._client.connection_pool.get_connection()
                    except Exception as exc:
                        raise RedisUnavailable(f"redis unavailable: {type(exc).__name__}: {exc}") from None
        if self._reader is None or self._reader.done():
            self._reader = asyncio.create_task(self._read_replies(), name="redis-replies")
        return self._conn

    async def _fail(self, conn: AbstractConnection, exc: BaseException) -> None:
        """Drop ``conn`` (its read position is unknown) and fail every unanswered command on it."""
        if conn is not self._conn:
            return  # an error from a connection already replaced
        self._conn = None
        err = RedisUnavailable(f"redis unavailable: {type(exc).__name__}: {exc}")
        while self._waiting:
            future = self._waiting.popleft()
            if not future.done():
                future.set_exception(err)
                future.exception()  # retrieved: a caller that already left must not log "never retrieved"
        await conn.disconnect()
        await self._client.connection_pool.release(conn)

    async def _read_replies(self) -> None:
        while True:
            if not self._waiting:
                self._replies_due.clear()
                await self._replies_due.wait()
                continue
            conn = self._conn
            if conn is None:
                await asyncio.sleep(0)
                continue
            try:
                reply: Any = await conn.read_response()
            except ResponseError as err:
                reply = err
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                await self._fail(conn, exc)
                continue
            if conn is not self._conn or not self._waiting:
                continue
            future = self._waiting.popleft()
            if future.done():  # its caller went away; Redis still did the work
                continue
            if isinstance(reply, Exception):
                future.set_exception(reply)
            else:
                future.set_result(reply)
