"""The gateway inside vLLM's API server process (``serving.gatewayMode: inProcess``, issue 40): no second hop.

In the default ``sidecar`` mode the gateway is its own process and reaches vLLM over loopback HTTP: every completion
is parsed and written twice (client -> gateway, gateway -> vLLM), crosses two sockets and wakes two event loops. That
hop, not the gateway's own Python (under 100 µs a request, bench/RESULTS.md), was most of the gateway's share of a
Tab completion's latency. Here vLLM's OpenAI server loads :class:`InProcessGateway` with ``--middleware``; when vLLM's
app starts (its ASGI lifespan), the middleware starts the very same gateway app (:func:`gateway.create_app`: auth,
routing, capture, the record written before ``[DONE]``) on the gateway's own port, in vLLM's event loop, with an
:class:`InProcessEngine` in place of the socket pool: a request to vLLM is a direct ASGI call into vLLM's app.

What stays as it is: vLLM still listens on loopback only (``serving.engineUrl``), so its admin routes (LoRA load and
unload, full-weight dev routes) stay out of reach of anything outside the pod; the reloader still talks to it there;
the gateway's port, routes, metrics and behaviour are those of the sidecar. A failure to start the gateway (bad config,
port taken, Redis URL missing) fails vLLM's startup: a replica without its gateway must not look alive.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import signal
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson

from onlinerl.asgi import ASGIApp, Receive, Scope, Send, http_scope
from onlinerl_serving import vllm_token_strings
from onlinerl_serving.upstream import EngineTimeout, EngineUnavailable, with_queued
from onlinerl_serving.vllm_completions import DirectAnswer, DirectCompletions

log = logging.getLogger("onlinerl.gateway.inprocess")

_EOF = object()
START_TIMEOUT_SECONDS = 30.0
COMPLETIONS = "/v1/completions"


class InProcessResponse:
    """One in-process request to vLLM's app, as :class:`onlinerl_serving.upstream.UpstreamResponse` reads: status
    and headers once vLLM started its response, then the body in pieces; :meth:`aclose` always.

    vLLM's handlers watch ``receive`` for the client leaving (non-streaming: ``with_cancellation``; streaming:
    Starlette's disconnect listener) and abort the generation when it says ``http.disconnect``; :meth:`aclose` on an
    unfinished response says exactly that, as closing the socket did in sidecar mode."""

    def __init__(self, read_timeout: float, body: bytes, client_receive: Receive | None = None) -> None:
        self.read_timeout = read_timeout
        self._client_receive = client_receive
        self.client_left = False
        self.status_code = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self._body = body
        self._sent_body = False
        self._gone = asyncio.Event()
        self._items: collections.deque = collections.deque()
        self._waiter: asyncio.Future | None = None
        self._done = False
        self._whole: bytes | None = None
        self._payload: Any = None  # a direct answer's parsed body (vllm_completions): never encoded to be parsed
        self.via = "asgi"
        self.task: asyncio.Task | None = None

    @classmethod
    def of_direct(cls, answer: DirectAnswer, read_timeout: float) -> InProcessResponse:
        """A finished response from vLLM's handler called directly (``DirectCompletions``)."""
        resp = cls(read_timeout, b"")
        resp.status_code, resp.client_left, resp._done = answer.status, answer.client_left, True
        resp.headers, resp.via = [(b"content-type", b"application/json")], "direct"
        if answer.payload is not None:
            resp._payload = answer.payload
        else:
            resp._whole = answer.body
        return resp

    # --- the ASGI side, called by vLLM's app ----------------------------------------------------------------
    async def receive(self) -> dict:
        if not self._sent_body:
            self._sent_body = True
            return {"type": "http.request", "body": self._body, "more_body": False}
        if self._client_receive is not None:  # the gateway's client, whose body was read: only its leaving is left
            while (await self._client_receive())["type"] != "http.disconnect":
                pass
            if not self._done:
                self.client_left = True
            return {"type": "http.disconnect"}
        await self._gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            self.status_code = int(message["status"])
            self.headers = [(bytes(k).lower(), bytes(v)) for k, v in message.get("headers", ())]
            self._push(None)
        elif kind == "http.response.body":
            body = message.get("body", b"")
            if body:
                self._push(bytes(body))
            if not message.get("more_body", False):  # vLLM's response's last piece (not a request body)
                self._push(_EOF)

    def finished(self, task: asyncio.Task) -> None:
        """The app returned (or failed): whatever the reader still waits for must end."""
        exc = None if task.cancelled() else task.exception()
        if exc is not None:
            self._push(EngineUnavailable(f"the engine failed: {type(exc).__name__}: {exc}"))
        self._push(_EOF)

    def _push(self, item: object) -> None:
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def _next(self) -> object:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await asyncio.wait_for(self._waiter, self.read_timeout)
            except TimeoutError:
                raise EngineTimeout(f"no answer from the engine within {self.read_timeout:.0f} s") from None
            finally:
                self._waiter = None
        item = self._items.popleft()
        if isinstance(item, BaseException):
            raise item
        return item

    # --- the gateway side -----------------------------------------------------------------------------------
    async def wait_head(self) -> None:
        item = await self._next()
        if item is _EOF:
            self._done = True
            raise EngineUnavailable("the engine ended the request without a response")

    async def chunks(self) -> AsyncIterator[bytes]:
        """Body data as vLLM sends it; pieces already queued come as one (one relay write instead of many)."""
        while not self._done:
            item = await self._next()
            if item is _EOF:
                self._done = True
                return
            yield with_queued(item, self._items)  # type: ignore[arg-type]

    async def read(self) -> bytes:
        if self._whole is None:
            if self._payload is not None:
                self._whole = orjson.dumps(self._payload)
            else:
                self._whole = b"".join([c async for c in self.chunks()])
        return self._whole

    async def json(self) -> Any:
        """The body parsed; a direct answer's dict as it is."""
        if self._payload is not None:
            return self._payload
        return orjson.loads(await self.read())

    async def aclose(self) -> None:
        """Unfinished: tell vLLM the client left (it aborts the generation), then make sure its handler ends."""
        if self._done or self.task is None or self.task.done():
            return
        self._gone.set()
        await asyncio.sleep(0)  # let the handler's disconnect listener see it and abort cleanly
        if not self.task.done():
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.task


class InProcessEngine:
    """The engine client of the gateway (the interface of :class:`onlinerl_serving.upstream.EnginePool`) over
    vLLM's own ASGI app in this process. ``app_scope`` holds what Starlette gives each request of vLLM's app (the
    app object, whose ``state`` vLLM's handlers read, and the lifespan state); it is filled at vLLM's startup."""

    relays_client_disconnect = True

    def __init__(self, app: ASGIApp, *, read_timeout: float) -> None:
        self.app = app
        self.read_timeout = read_timeout
        self.app_scope: dict[str, Any] = {}
        self.direct: DirectCompletions | None = None  # vLLM's completion handler as a function (set at startup)
        self._tasks: set[asyncio.Task] = set()

    def _scope(self, method: str, path: str, body: bytes) -> Scope:
        headers = [
            (b"host", b"in-process"),
            (b"content-type", b"application/json"),
            (b"accept", b"*/*"),
            (b"content-length", str(len(body)).encode("latin-1")),
        ]
        scope = http_scope(method, path, headers)
        if "app" in self.app_scope:
            scope["app"] = self.app_scope["app"]
        if self.app_scope.get("state") is not None:
            scope["state"] = dict(self.app_scope["state"])
        return scope

    async def request(
        self, method: str, path: str, body: bytes, client_receive: Receive | None = None
    ) -> InProcessResponse:
        """``client_receive``: the gateway's client's ASGI receive (its body already read). vLLM's handler then
        watches the client itself, as it watches a socket, and aborts the generation when the client leaves; the
        response says so (``client_left``)."""
        resp = InProcessResponse(self.read_timeout, body, client_receive)
        task = asyncio.ensure_future(self.app(self._scope(method, path, body), resp.receive, resp.send))
        resp.task = task
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(resp.finished)
        try:
            await resp.wait_head()
        except BaseException:
            await resp.aclose()
            raise
        return resp

    async def post(self, path: str, body: bytes, client_receive: Receive | None = None) -> InProcessResponse:
        return await self.request("POST", path, body, client_receive)

    async def post_whole(self, path: str, body: bytes, client_receive: Receive) -> InProcessResponse:
        """A non-streaming request, run to its end inside the caller's task: the response comes back whole.

        Why not :meth:`post`: the gateway needs the whole body before it can record anything, and vLLM sends its
        headers only when the generation is done. A task of its own for vLLM's handler, the wait for its headers and
        the wait for its body each cost a turn of vLLM's event loop on the user's path; here there are none. The
        client's leaving still reaches vLLM's handler through ``client_receive`` (it aborts, and ``client_left``
        says so), and the engine's read timeout still applies.

        ``/v1/completions`` goes straight to vLLM's handler when :attr:`direct` is set and takes the body
        (vllm_completions.py): no HTTP route, no JSON written to be parsed again."""
        direct = self.direct if path == COMPLETIONS else None
        request = direct.request_of(body) if direct is not None else None
        resp = InProcessResponse(self.read_timeout, body, client_receive)
        try:
            async with asyncio.timeout(self.read_timeout):
                if direct is not None and request is not None:
                    return InProcessResponse.of_direct(
                        await direct.complete(request, client_receive), self.read_timeout
                    )
                await self.app(self._scope("POST", path, body), resp.receive, resp.send)
        except TimeoutError:
            raise EngineTimeout(f"no answer from the engine within {self.read_timeout:.0f} s") from None
        except Exception as exc:
            raise EngineUnavailable(f"the engine failed: {type(exc).__name__}: {exc}") from exc
        resp._push(_EOF)  # the app returned: nothing more will come
        if not resp.client_left:  # vLLM aborted for a client that left: whatever it answered, nobody reads it
            await resp.wait_head()
        return resp

    async def get_bytes(self, path: str) -> tuple[int, bytes]:
        resp = await self.request("GET", path, b"")
        try:
            return resp.status_code, await resp.read()
        finally:
            await resp.aclose()

    def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()


class InProcessGateway:
    """ASGI middleware for vLLM's ``--middleware``: passes every vLLM request through untouched, and runs the
    gateway beside vLLM's app for as long as vLLM's app lives (its lifespan)."""

    def __init__(self, app: ASGIApp, *, config_loader: Callable[[], Any] | None = None) -> None:
        self.app = app
        self.config_loader = config_loader
        self.engine: InProcessEngine | None = None
        self._server: Any = None
        self._serving: asyncio.Task | None = None
        self._stopping = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            await self.app(scope, receive, send)
            return

        async def send_wrapped(message: dict) -> None:
            if message["type"] == "lifespan.startup.complete":
                try:
                    await self.start(scope)
                except Exception as exc:
                    log.exception("the in-process gateway did not start")
                    await send({"type": "lifespan.startup.failed", "message": f"onlinerl gateway: {exc}"})
                    return
            await send(message)

        async def receive_wrapped() -> dict:
            message = await receive()
            if message["type"] == "lifespan.shutdown":
                await self.stop()
            return message

        await self.app(scope, receive_wrapped, send_wrapped)

    async def start(self, lifespan_scope: Scope) -> None:
        from onlinerl.config import load_config
        from onlinerl_serving.gateway import create_app

        log_like_the_sidecar()
        cfg = (self.config_loader or load_config)()
        self.engine = InProcessEngine(self.app, read_timeout=cfg.serving.request_timeout_seconds)
        self.engine.app_scope = {"app": lifespan_scope.get("app"), "state": lifespan_scope.get("state")}
        self.engine.direct = DirectCompletions.for_app(lifespan_scope.get("app"))
        vllm_token_strings.install_and_fill(lifespan_scope.get("app"))
        self._server = server_in_this_loop(create_app(cfg, engine=self.engine), cfg.serving.host, cfg.serving.port)
        # Server.serve() would take over SIGINT/SIGTERM from vLLM's own server; _serve() is serve() without that.
        serve = getattr(self._server, "_serve", self._server.serve)

        async def serve_or_fail() -> None:
            try:
                await serve()
            except SystemExit as exc:  # uvicorn exits when it cannot bind: here that must not end vLLM's loop
                raise RuntimeError(f"uvicorn exited ({exc.code})") from None

        self._serving = asyncio.ensure_future(serve_or_fail())
        started = asyncio.ensure_future(_until(lambda: self._server.started or self._serving.done()))
        try:
            await asyncio.wait_for(started, START_TIMEOUT_SECONDS)
        except TimeoutError:
            raise RuntimeError(f"the gateway did not start within {START_TIMEOUT_SECONDS:.0f} s") from None
        if self._serving.done():  # uvicorn exits (SystemExit) when it cannot bind or its lifespan fails
            exc = None if self._serving.cancelled() else self._serving.exception()
            raise RuntimeError(f"the gateway could not start on {cfg.serving.host}:{cfg.serving.port}: {exc!r}")
        self._serving.add_done_callback(self._ended)
        log.info("onlinerl gateway in vLLM's process on %s:%s", cfg.serving.host, cfg.serving.port)

    def _ended(self, task: asyncio.Task) -> None:
        """The gateway's server stopped while vLLM runs on: a replica nobody can reach. Stop vLLM too (SIGTERM, its
        own orderly shutdown), so that the pod's or the local stack's supervisor restarts the whole replica."""
        if self._stopping:
            return
        exc = None if task.cancelled() else task.exception()
        log.error("the in-process gateway stopped (%r): stopping vLLM so that the replica is restarted", exc)
        os.kill(os.getpid(), signal.SIGTERM)

    async def stop(self) -> None:
        self._stopping = True
        if self._server is None or self._serving is None:
            return
        self._server.should_exit = True
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await asyncio.wait_for(self._serving, 30)
        if self.engine is not None:
            self.engine.close()


def server_in_this_loop(app: ASGIApp, host: str, port: int, lifespan: str = "on") -> Any:
    """A uvicorn server for ``app`` to run in vLLM's event loop (``_serve()``, not ``serve()``, which would take
    SIGINT and SIGTERM from vLLM's own server): options as every onlinerl front end has them (onlinerl.asgi.serve)."""
    import uvicorn

    from onlinerl.asgi import KEEP_ALIVE_SECONDS

    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        lifespan=lifespan,
        http="httptools",
        timeout_keep_alive=KEEP_ALIVE_SECONDS,
    )
    return uvicorn.Server(config)


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"  # the sidecar's (gateway.main)


def log_like_the_sidecar() -> None:
    """vLLM configures only its own ``vllm`` loggers: without this, the gateway's INFO lines (and the timestamps of
    its errors) would be lost in vLLM's process. Adds the sidecar's handler to ``onlinerl`` unless someone already
    configured logging (a root handler, or one on ``onlinerl``)."""
    ours = logging.getLogger("onlinerl")
    if ours.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    ours.addHandler(handler)
    ours.setLevel(logging.INFO)
    ours.propagate = False


async def _until(predicate: Callable[[], bool], interval: float = 0.02) -> None:
    while not predicate():
        await asyncio.sleep(interval)
