"""A lean HTTP/1.1 client for the gateway's hot path: keep-alive connections to vLLM, parsed with httptools.

httpx costs about 1 ms of CPU per proxied request (h11 parsing and anyio layers, measured with a CPU-time profile);
this client is one asyncio Protocol per connection feeding httptools, the C parser uvicorn itself uses. It does only
what the gateway needs: POST a JSON body to one host, stream the (de-chunked) response body, reuse idle connections.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

import httptools
import orjson

_EOF = object()
IDLE_SECONDS = 4.0  # below uvicorn's 5 s keep-alive timeout in vLLM: never reuse a connection the server may drop


class EngineUnavailable(ConnectionError):
    """No connection, or it broke before a response arrived: the caller answers 503."""


class EngineTimeout(EngineUnavailable):
    """Connected, but no data within the read timeout (``serving.requestTimeoutSeconds``): the engine is up but too
    slow for this request (e.g. a long ``max_tokens`` on CPU). The caller answers 504, not 503: a client told "down,
    retry" would only send the same slow request again."""


class _Connection(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.items: collections.deque = collections.deque()
        self.waiter: asyncio.Future | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.keep_alive = False
        self.closed = False
        self.got_response = False
        self.idle_since = time.monotonic()

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.got_response = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._push(EngineUnavailable(f"malformed response from the engine: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._push(EngineUnavailable(f"engine connection lost: {exc or 'closed by peer'}"))

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self._push(None)

    def on_body(self, body: bytes) -> None:
        self._push(bytes(body))

    def on_message_complete(self) -> None:
        self.keep_alive = self.parser.should_keep_alive()
        self._push(_EOF)

    def _push(self, item: object) -> None:
        self.items.append(item)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def next_item(self, timeout: float) -> object:
        if not self.items:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await asyncio.wait_for(self.waiter, timeout)
            except TimeoutError:
                self.close()
                raise EngineTimeout(f"no data from the engine for {timeout:g}s") from None
            finally:
                self.waiter = None
        item = self.items.popleft()
        if isinstance(item, BaseException):
            raise item
        return item

    def reset(self) -> None:
        self.items.clear()
        self.parser = httptools.HttpResponseParser(self)
        self.status, self.headers, self.keep_alive, self.got_response = 0, [], False, False

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


def with_queued(piece: bytes, queue: collections.deque) -> bytes:
    """``piece`` joined with the body pieces already queued behind it (one relay write instead of many: vLLM sends
    each token as its own piece, and a socket write costs tens of microseconds); stops at anything not bytes."""
    if not (queue and isinstance(queue[0], bytes)):
        return piece
    pieces = [piece]
    while queue and isinstance(queue[0], bytes):
        pieces.append(queue.popleft())
    return b"".join(pieces)


class UpstreamResponse:
    """A response being received; iterate :meth:`chunks` or call :meth:`read`, then always :meth:`aclose`."""

    def __init__(self, pool: EnginePool, conn: _Connection) -> None:
        self._pool, self._conn = pool, conn
        self.status_code = conn.status
        self.headers = conn.headers
        self._done = False
        self._body: bytes | None = None
        self.client_left = False
        self.via = "socket"

    async def chunks(self) -> AsyncIterator[bytes]:
        """Body data as it arrives; pieces that arrived together come as one (one relay write instead of many:
        vLLM sends each token as its own HTTP chunk, and a socket write costs tens of microseconds)."""
        while not self._done:
            item = await self._conn.next_item(self._pool.read_timeout)
            if item is _EOF:
                self._done = True
                return
            yield with_queued(item, self._conn.items)  # type: ignore[arg-type]

    async def read(self) -> bytes:
        """The whole body (read once; later calls return it again)."""
        if self._body is None:
            self._body = b"".join([c async for c in self.chunks()])
        return self._body

    async def json(self) -> Any:
        """The whole body, parsed."""
        return orjson.loads(await self.read())

    async def aclose(self) -> None:
        """Back to the pool if the response was read to the end; else close (vLLM aborts the request)."""
        if self._done and self._conn.keep_alive and not self._conn.closed:
            self._pool._release(self._conn)
        else:
            self._conn.close()


class EngineResponse(Protocol):
    """What the gateway reads of one engine response: :class:`UpstreamResponse` or an in-process one."""

    status_code: int
    headers: list[tuple[bytes, bytes]]
    client_left: bool  # the client's disconnect reached the engine (only an engine that relays it)
    via: str  # how it reached vLLM: "socket", "asgi" or "direct" (onlinerl_serving_engine_calls_total)

    def chunks(self) -> AsyncIterator[bytes]: ...

    async def read(self) -> bytes: ...

    async def json(self) -> Any: ...

    async def aclose(self) -> None: ...


class Engine(Protocol):
    """How the gateway reaches its vLLM: :class:`EnginePool` over loopback HTTP (sidecar mode), or
    ``inprocess.InProcessEngine`` as a direct ASGI call in vLLM's own process."""

    read_timeout: float
    relays_client_disconnect: bool  # post() can hand the client's own ASGI receive to the engine

    async def post(self, path: str, body: bytes, client_receive: Any = None) -> EngineResponse: ...

    async def post_whole(self, path: str, body: bytes, client_receive: Any) -> EngineResponse:
        """A non-streaming request's whole response, the engine watching the client (only an engine that relays
        the client's disconnect)."""
        ...

    async def get_bytes(self, path: str) -> tuple[int, bytes]: ...

    def close(self) -> None: ...


class EnginePool:
    """Keep-alive connections to one ``host:port``."""

    relays_client_disconnect = False  # over a socket the engine cannot see the gateway's client: the gateway watches

    def __init__(
        self, host: str, port: int, *, connect_timeout: float, read_timeout: float, max_idle: int = 128
    ) -> None:
        self.host, self.port = host, port
        self.connect_timeout, self.read_timeout = connect_timeout, read_timeout
        self.max_idle = max_idle
        self._idle: list[_Connection] = []

    @classmethod
    def from_url(cls, url: str, **kw: float) -> EnginePool:
        import urllib.parse

        u = urllib.parse.urlsplit(url)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"serving.engineUrl must be http://host:port (got {url!r}): vLLM stays on loopback")
        return cls(u.hostname, u.port or 80, **kw)

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(_Connection, self.host, self.port), self.connect_timeout
            )
        except (OSError, TimeoutError) as exc:
            raise EngineUnavailable(
                f"cannot connect to the engine at {self.host}:{self.port}: {type(exc).__name__} {exc}"
            ) from None
        return conn

    def _take_idle(self) -> _Connection | None:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed and now - conn.idle_since < IDLE_SECONDS:
                return conn
            conn.close()
        return None

    def _release(self, conn: _Connection) -> None:
        conn.reset()
        conn.idle_since = time.monotonic()
        if len(self._idle) < self.max_idle:
            self._idle.append(conn)
        else:
            conn.close()

    async def post(self, path: str, body: bytes, client_receive: Any = None) -> UpstreamResponse:
        """POST a JSON body and wait for the status line and headers."""
        if client_receive is not None:
            raise ValueError("a socket engine cannot watch the client: relays_client_disconnect is False")
        return await self.request("POST", path, body)

    async def post_whole(self, path: str, body: bytes, client_receive: Any) -> UpstreamResponse:
        raise ValueError("a socket engine cannot watch the client: relays_client_disconnect is False")

    async def get_bytes(self, path: str) -> tuple[int, bytes]:
        """GET ``path``; ``(status, body)`` read to the end."""
        resp = await self.request("GET", path, b"")
        try:
            return resp.status_code, await resp.read()
        finally:
            await resp.aclose()

    async def request(self, method: str, path: str, body: bytes) -> UpstreamResponse:
        """Send the request and wait for the status line and headers."""
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
            f"Accept: */*\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode("latin-1")
        for attempt in (0, 1):
            conn = self._take_idle()
            reused = conn is not None
            if conn is None:
                conn = await self._connect()
            assert conn.transport is not None
            conn.transport.write(head + body)
            try:
                await conn.next_item(self.read_timeout)  # headers complete
            except asyncio.CancelledError:
                conn.close()  # the caller gave up (its client left): closing makes vLLM abort the request
                raise
            except EngineUnavailable as exc:
                conn.close()
                if reused and attempt == 0 and not conn.got_response and not isinstance(exc, EngineTimeout):
                    continue  # the server closed an idle keep-alive connection under us: one fresh try
                raise
            return UpstreamResponse(self, conn)
        raise EngineUnavailable("engine connection failed")

    def close(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()
