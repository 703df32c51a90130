"""ASGI plumbing shared by the services' HTTP front ends."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def http_scope(
    method: str,
    path: str,
    headers: list[tuple[bytes, bytes]],
    client: tuple[str, int] = ("127.0.0.1", 0),
    server: tuple[str, int] = ("127.0.0.1", 0),
) -> dict[str, Any]:
    """The ASGI scope of one HTTP/1.1 request as a server hands it to an app (no query string): for the callers that
    play the server themselves (the in-process engine client calling vLLM's app, the gateway-alone benchmark)."""
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode("latin-1"),
        "query_string": b"",
        "root_path": "",
        "headers": headers,
        "client": client,
        "server": server,
    }


def with_hot_route(app: ASGIApp, method: str, path: str, handler: ASGIApp) -> ASGIApp:
    """``method path`` goes straight to ``handler``; everything else (lifespan included) to ``app``.

    For the one route that carries the traffic: a framework's middleware stack, routing and request objects cost
    more CPU per request there than the route's own work (py-spy, bench/). Other routes keep the framework."""

    async def asgi(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == path and scope["method"] == method:
            await handler(scope, receive, send)
        else:
            await app(scope, receive, send)

    return asgi


async def read_capped(
    receive: Receive, cap: int, too_large: Callable[[], Exception], disconnected: Callable[[], Exception]
) -> bytes:
    """The request body, refusing to buffer more than ``cap`` bytes whatever Content-Length claimed (chunked uploads).

    Each service raises its own error (``too_large()`` over the cap, ``disconnected()`` when the client leaves
    mid-body): the message names the config field that sets its cap, which only the service knows."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise disconnected()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > cap:
            raise too_large()
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


# An idle keep-alive connection is closed by the client, never by us. uvicorn's default (5 s) equals httpx's own
# idle expiry (5 s; Node's undici: 4 s), so a client reusing a connection at the moment we drop it gets "server
# disconnected without sending a response" on a POST it must not retry blindly (seen in CI right after a gateway
# restart). Above the idle timeouts of the proxies in front of us too (nginx upstream, cloud load balancers: 60 s).
KEEP_ALIVE_SECONDS = 75


def serve(app: Any, host: str, port: int, **overrides: Any) -> None:
    """Run an ASGI app the way every onlinerl front end runs: uvloop + httptools (the fast parsers the latency
    figures were measured with), lifespan on, no access log (a line per completion is the metrics' job), idle
    connections kept ``KEEP_ALIVE_SECONDS``."""
    import uvicorn

    options: dict[str, Any] = dict(
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        lifespan="on",
        loop="uvloop",
        http="httptools",
        timeout_keep_alive=KEEP_ALIVE_SECONDS,
    )
    uvicorn.run(app, **{**options, **overrides})
