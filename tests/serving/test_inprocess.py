"""The in-process engine client (serving.gatewayMode: inProcess, issue 40) against a real Starlette app standing in
for vLLM's FastAPI app, which is a Starlette app as well: the same ASGI contract the gateway relies on in vLLM's
process. What vLLM itself does behind the middleware (records, switches, replicas) is tested through real vLLM in
tests/loop/test_replicas_e2e.py, whose stack runs in this mode.

Asserted: status, headers and body as the app sent them; a streamed body piece by piece; the app's errors and its
silence become the gateway's EngineUnavailable (503) and EngineTimeout (504); and a response closed before its end
tells the app that its client left (``http.disconnect``), which is how vLLM aborts a generation nobody will read.
"""

from __future__ import annotations

import asyncio

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from onlinerl_serving.inprocess import InProcessEngine, InProcessGateway
from onlinerl_serving.upstream import EngineTimeout, EngineUnavailable


class FakeVllm:
    """A Starlette app with vLLM's shapes of answer: JSON, SSE, an error, silence; it notes what it saw."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.stream_closed = asyncio.Event()
        self.disconnect_seen = asyncio.Event()
        self.app_seen: list[object] = []

    async def completions(self, request: Request):
        body = await request.body()
        self.bodies.append(body)
        self.app_seen.append(request.app)
        if b'"stream": true' not in body:
            return JSONResponse({"echo": body.decode()}, headers={"x-engine": "1"})

        async def events():
            try:
                for i in range(3):
                    yield f"data: {i}\n\n".encode()
                    await asyncio.sleep(0)
                if b"endless" in body:
                    while True:
                        yield b"data: more\n\n"
                        await asyncio.sleep(0.01)
                yield b"data: [DONE]\n\n"
            finally:
                self.stream_closed.set()

        return StreamingResponse(events(), media_type="text/event-stream")

    async def boom(self, request: Request):
        raise RuntimeError("engine core died")

    async def silent(self, request: Request):
        await asyncio.sleep(3600)

    async def waits_for_client(self, request: Request):
        """Generates until its client leaves: told by ``http.disconnect`` or cancelled (vLLM aborts on either)."""
        try:
            while not await request.is_disconnected():
                await asyncio.sleep(0.01)
        finally:
            self.disconnect_seen.set()
        return JSONResponse({})

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/boom", self.boom, methods=["POST"]),
                Route("/silent", self.silent, methods=["POST"]),
                Route("/wait", self.waits_for_client, methods=["POST"]),
            ]
        )


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_a_json_answer_arrives_whole_with_status_headers_and_the_request_body() -> None:
    async def go() -> None:
        fake = FakeVllm()
        app = fake.app()
        engine = InProcessEngine(app, read_timeout=5)
        engine.app_scope = {"app": app}
        resp = await engine.post("/v1/completions", b'{"prompt": "x"}')
        assert resp.status_code == 200
        assert (b"x-engine", b"1") in resp.headers
        assert await resp.read() == b'{"echo":"{\\"prompt\\": \\"x\\"}"}'
        await resp.aclose()
        assert fake.bodies == [b'{"prompt": "x"}']
        assert fake.app_seen == [app]  # the handler sees vLLM's own app (its state holds the engine client)
        status, body = await engine.get_bytes("/nowhere")
        assert (status, body) == (404, b"Not Found")

    run(go())


def test_a_stream_arrives_in_order_and_ends() -> None:
    async def go() -> None:
        fake = FakeVllm()
        engine = InProcessEngine(fake.app(), read_timeout=5)
        resp = await engine.post("/v1/completions", b'{"stream": true}')
        assert resp.status_code == 200
        got = b"".join([c async for c in resp.chunks()])
        assert got == b"data: 0\n\ndata: 1\n\ndata: 2\n\ndata: [DONE]\n\n"
        await resp.aclose()
        assert fake.stream_closed.is_set()

    run(go())


def test_closing_an_unfinished_stream_tells_the_app_its_client_left() -> None:
    async def go() -> None:
        fake = FakeVllm()
        engine = InProcessEngine(fake.app(), read_timeout=5)
        resp = await engine.post("/v1/completions", b'{"stream": true, "endless": 1}')
        pieces = resp.chunks()
        assert (await pieces.__anext__()).startswith(b"data: 0")
        await resp.aclose()
        await asyncio.wait_for(fake.stream_closed.wait(), 5)  # the generator was closed: vLLM aborts there

    run(go())


def test_a_request_given_up_before_its_answer_ends_the_handler() -> None:
    async def go() -> None:
        fake = FakeVllm()
        engine = InProcessEngine(fake.app(), read_timeout=5)
        task = asyncio.ensure_future(engine.post("/wait", b"{}"))
        await asyncio.sleep(0.05)
        task.cancel()  # the gateway gave up (its own client left) before vLLM answered
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(fake.disconnect_seen.wait(), 5)

    run(go())


def test_an_app_error_is_engine_unavailable_and_silence_is_a_timeout() -> None:
    async def go() -> None:
        fake = FakeVllm()
        engine = InProcessEngine(fake.app(), read_timeout=0.3)
        resp = await engine.post("/boom", b"{}")  # Starlette's ServerErrorMiddleware answers 500 first
        assert resp.status_code == 500
        await resp.aclose()
        raw = InProcessEngine(fake.app().router, read_timeout=0.3)  # below it, the exception itself
        with pytest.raises(EngineUnavailable, match="engine core died"):
            await raw.post("/boom", b"{}")
        with pytest.raises(EngineTimeout):
            await engine.post("/silent", b"{}")
        assert not engine._tasks  # the silent handler was cancelled, not left running

    run(go())


def test_a_gateway_that_cannot_start_fails_the_engine_startup() -> None:
    """A replica whose gateway did not start must not report itself started (vLLM then exits)."""

    def bad_config():
        raise ValueError("redis.url is required")

    async def go() -> None:
        fake = FakeVllm()
        middleware = InProcessGateway(fake.app(), config_loader=bad_config)
        sent: list[dict] = []
        messages = iter([{"type": "lifespan.startup"}])

        async def receive() -> dict:
            try:
                return next(messages)
            except StopIteration:
                await asyncio.sleep(3600)
                raise

        async def send(message: dict) -> None:
            sent.append(message)

        task = asyncio.ensure_future(middleware({"type": "lifespan", "asgi": {"version": "3.0"}}, receive, send))
        for _ in range(200):
            if sent:
                break
            await asyncio.sleep(0.01)
        task.cancel()
        assert sent and sent[0]["type"] == "lifespan.startup.failed"
        assert "redis.url is required" in sent[0]["message"]

    run(go())


def test_the_gateway_serves_beside_the_app_for_its_lifespan_and_a_gateway_that_dies_stops_the_process(
    empty_valkey, monkeypatch
) -> None:
    """Started at the app's startup, the gateway answers on its own port (its /readyz reads the app's /v1/models
    through the in-process engine); stopped at the app's shutdown, it sends no signal. A gateway server that ends on
    its own (vLLM running on, unreachable) makes the process stop itself: SIGTERM to its own pid."""
    import os
    import signal

    import httpx

    from onlinerl.config import from_mapping
    from onlinerl.valkey import free_port
    from onlinerl_serving import inprocess

    signals: list[tuple[int, int]] = []
    monkeypatch.setattr(inprocess.os, "kill", lambda pid, sig: signals.append((pid, sig)))
    port = free_port()
    cfg = from_mapping(
        {
            "redis": {"url": empty_valkey.url},
            "auth": {"allowAnonymous": True},
            "serving": {"host": "127.0.0.1", "port": port},
            "model": {"servedName": "base"},
        }
    )

    async def models(request: Request):
        return JSONResponse({"data": [{"id": "base"}]})

    app = Starlette(routes=[Route("/v1/models", models)])

    async def lifespan_of(middleware: InProcessGateway, stop: asyncio.Event) -> list[str]:
        sent: list[str] = []
        messages = [{"type": "lifespan.startup"}]

        async def receive() -> dict:
            if messages:
                return messages.pop(0)
            await stop.wait()
            return {"type": "lifespan.shutdown"}

        async def send(message: dict) -> None:
            sent.append(message["type"])

        await middleware({"type": "lifespan", "asgi": {"version": "3.0"}, "app": app}, receive, send)
        return sent

    async def serving(middleware: InProcessGateway) -> None:
        for _ in range(100):
            if middleware._server is not None and middleware._server.started:
                return
            await asyncio.sleep(0.05)
        raise AssertionError("the in-process gateway did not start")

    async def go() -> None:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as http:
            stop = asyncio.Event()
            middleware = InProcessGateway(app, config_loader=lambda: cfg)
            life = asyncio.ensure_future(lifespan_of(middleware, stop))
            await serving(middleware)
            ready = (await http.get("/readyz")).json()
            assert ready["engine"] and ready["loaded_versions"] == [0]  # the app's /v1/models, called in-process
            stop.set()
            assert await asyncio.wait_for(life, 30) == ["lifespan.startup.complete", "lifespan.shutdown.complete"]
            assert signals == []  # an orderly shutdown
            # again, and this time the gateway's server ends by itself
            stop = asyncio.Event()
            middleware = InProcessGateway(app, config_loader=lambda: cfg)
            life = asyncio.ensure_future(lifespan_of(middleware, stop))
            await serving(middleware)
            middleware._server.should_exit = True
            for _ in range(100):
                if signals:
                    break
                await asyncio.sleep(0.05)
            assert signals == [(os.getpid(), signal.SIGTERM)]
            stop.set()
            await asyncio.wait_for(life, 30)

    run(go())


def test_a_client_that_leaves_reaches_the_handler_through_its_own_receive() -> None:
    """Non-streaming, the gateway hands the client's receive to the engine: the handler sees the client leave as it
    would see its socket close, and the response says the client left (the gateway answers 499, records nothing)."""

    async def go() -> None:
        fake = FakeVllm()
        engine = InProcessEngine(fake.app(), read_timeout=5)
        leaves = asyncio.Event()

        async def client_receive() -> dict:
            await leaves.wait()
            return {"type": "http.disconnect"}

        task = asyncio.ensure_future(engine.post("/wait", b"{}", client_receive))
        await asyncio.sleep(0.05)
        assert not fake.disconnect_seen.is_set()
        leaves.set()
        resp = await asyncio.wait_for(task, 5)  # the handler returned once it saw the disconnect
        assert fake.disconnect_seen.is_set() and resp.client_left
        await resp.aclose()
        # a client that stays: answered as usual, not marked
        leaves = asyncio.Event()
        resp = await engine.post("/v1/completions", b"{}", client_receive)
        assert await resp.read() and not resp.client_left

    run(go())


def test_post_whole_runs_the_handler_in_the_callers_task_with_the_same_contract() -> None:
    """The gateway's non-streaming path (``post_whole``): vLLM's handler runs in the gateway's own task, to its end.
    The same answers as ``post``: status, headers and body whole; an app error is EngineUnavailable and silence a
    timeout that ends the handler; a client that leaves reaches the handler and is reported; a cancelled caller
    cancels the handler (which sees it, as vLLM aborts on cancellation)."""

    async def go() -> None:
        fake = FakeVllm()
        app = fake.app()
        engine = InProcessEngine(app, read_timeout=0.3)
        engine.app_scope = {"app": app}
        stays = asyncio.Event()

        async def client_receive() -> dict:
            await stays.wait()
            return {"type": "http.disconnect"}

        tasks_before = len(asyncio.all_tasks())
        resp = await engine.post_whole("/v1/completions", b'{"prompt": "x"}', client_receive)
        assert resp.status_code == 200 and (b"x-engine", b"1") in resp.headers and not resp.client_left
        assert await resp.read() == b'{"echo":"{\\"prompt\\": \\"x\\"}"}'
        await resp.aclose()
        assert len(asyncio.all_tasks()) <= tasks_before + 1  # no task of its own (Starlette's listener at most)
        assert fake.app_seen == [app]

        raw = InProcessEngine(app.router, read_timeout=0.3)
        with pytest.raises(EngineUnavailable, match="engine core died"):
            await raw.post_whole("/boom", b"{}", client_receive)
        with pytest.raises(EngineTimeout):
            await engine.post_whole("/silent", b"{}", client_receive)

        leaves = asyncio.Event()

        async def leaving_receive() -> dict:
            await leaves.wait()
            return {"type": "http.disconnect"}

        slow = InProcessEngine(app, read_timeout=5)
        task = asyncio.ensure_future(slow.post_whole("/wait", b"{}", leaving_receive))
        await asyncio.sleep(0.05)
        assert not fake.disconnect_seen.is_set()
        leaves.set()
        resp = await asyncio.wait_for(task, 5)
        assert fake.disconnect_seen.is_set() and resp.client_left

        fake.disconnect_seen.clear()
        task = asyncio.ensure_future(slow.post_whole("/wait", b"{}", client_receive))
        await asyncio.sleep(0.05)
        task.cancel()  # the gateway's task is cancelled (server shutdown): the handler ends with it
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(fake.disconnect_seen.wait(), 5)

    run(go())
