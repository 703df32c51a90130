"""The gateway's HTTP/1.1 engine client against a real socket server that misbehaves on purpose."""

from __future__ import annotations

import asyncio

import pytest

from onlinerl_serving.upstream import EnginePool, EngineUnavailable

CHUNKED = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    b"8\r\ndata: a\n\r\na\r\ndata: bc\n\n\r\n0\r\n\r\n"
)


async def _serve(handler) -> tuple[asyncio.AbstractServer, int]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.lower().split(b"\r\n")
    length = int(next(line.split(b":")[1] for line in lines if line.startswith(b"content-length")))
    return await reader.readexactly(length)


async def test_streams_dechunked_body_and_survives_idle_close() -> None:
    """The server answers, then drops the idle keep-alive connection: the next POST must still succeed."""
    bodies = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        bodies.append(await _read_request(reader))
        writer.write(CHUNKED)
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.close()  # like uvicorn's keep-alive timeout, but sooner

    server, port = await _serve(handler)
    pool = EnginePool("127.0.0.1", port, connect_timeout=1, read_timeout=5)
    try:
        for i in range(3):
            resp = await pool.post("/v1/completions", b'{"n": %d}' % i)
            assert resp.status_code == 200 and (b"content-type", b"text/event-stream") in resp.headers
            assert b"".join([c async for c in resp.chunks()]) == b"data: a\ndata: bc\n\n"
            await resp.aclose()
            await asyncio.sleep(0.2)
        assert bodies == [b'{"n": 0}', b'{"n": 1}', b'{"n": 2}']
    finally:
        pool.close()
        server.close()


async def test_full_body_is_reassembled() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(CHUNKED)
        await writer.drain()

    server, port = await _serve(handler)
    pool = EnginePool("127.0.0.1", port, connect_timeout=1, read_timeout=5)
    try:
        resp = await pool.post("/x", b"{}")
        assert await resp.read() == b"data: a\ndata: bc\n\n"
        await resp.aclose()
        assert len(pool._idle) == 1  # read to the end: kept for reuse
    finally:
        pool.close()
        server.close()


async def test_engine_dying_mid_stream_raises_unavailable() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(CHUNKED[: CHUNKED.index(b"bc")])  # headers and part of the body, then the process "dies"
        await writer.drain()
        writer.transport.abort()

    server, port = await _serve(handler)
    pool = EnginePool("127.0.0.1", port, connect_timeout=1, read_timeout=5)
    try:
        resp = await pool.post("/x", b"{}")
        with pytest.raises(EngineUnavailable, match="connection lost"):
            await resp.read()
        await resp.aclose()
        assert not pool._idle
    finally:
        pool.close()
        server.close()


async def test_silent_engine_times_out_and_refused_connect_fails_fast() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        await asyncio.sleep(5)

    server, port = await _serve(handler)
    pool = EnginePool("127.0.0.1", port, connect_timeout=1, read_timeout=0.3)
    try:
        with pytest.raises(EngineUnavailable, match="no data from the engine"):
            await pool.post("/x", b"{}")
    finally:
        server.close()
    server.close()
    await server.wait_closed()
    dead = EnginePool("127.0.0.1", port, connect_timeout=1, read_timeout=1)
    with pytest.raises(EngineUnavailable, match="cannot connect"):
        await dead.post("/x", b"{}")


def test_engine_url_must_be_plain_http() -> None:
    with pytest.raises(ValueError, match="http://host:port"):
        EnginePool.from_url("https://engine:8001", connect_timeout=1, read_timeout=1)
    assert EnginePool.from_url("http://127.0.0.1:8001", connect_timeout=1, read_timeout=1).port == 8001


async def test_request_on_a_connection_the_server_drops_is_retried_once() -> None:
    """The race the idle timeout cannot rule out: our request reaches a connection the server is closing."""
    served = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        served.append(await _read_request(reader))
        writer.write(CHUNKED)
        await writer.drain()
        await _read_request(reader)  # a second request on this connection: drop it unanswered
        writer.transport.abort()

    server, port = await _serve(handler)
    pool = EnginePool("127.0.0.1", port, connect_timeout=1, read_timeout=5)
    try:
        for i in range(2):
            resp = await pool.post("/x", b'{"i": %d}' % i)
            assert await resp.read() == b"data: a\ndata: bc\n\n"
            await resp.aclose()
        assert served == [b'{"i": 0}', b'{"i": 1}']  # the second one answered on a fresh connection
    finally:
        pool.close()
        server.close()
