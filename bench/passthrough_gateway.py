"""A pass-through beside the in-process gateway, for `bench/serving_latency.py --in-process --passthrough` (issue 40).

The in-process gateway's share of a completion has two parts that end-to-end figures cannot tell apart: the plumbing
of running inside vLLM's process (a second uvicorn server in vLLM's event loop, the request handed to vLLM's app by
``InProcessEngine``, the response written again) and the gateway's own work (auth, validation, routing, the record,
the client's view). :class:`PassthroughGateway` is vLLM's ``--middleware`` for the benchmark: it starts the real
in-process gateway exactly as ``onlinerl_serving.inprocess.InProcessGateway`` does, and beside it, on
``$ONLINERL_BENCH_PASSTHROUGH_PORT``, an app with the same plumbing and none of the work: it hands the body it
gets to vLLM's app unchanged and writes back what vLLM answers. Timed with the gateway's own upstream body, on the same
vLLM and in the same interleaved rounds:

    pass-through - direct+cap   the plumbing;
    gateway - pass-through      the gateway's own work, inside vLLM's process.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from typing import Any

import orjson

from onlinerl.asgi import ASGIApp, Receive, Scope, Send, read_capped
from onlinerl_serving.inprocess import InProcessEngine, InProcessGateway, server_in_this_loop

PORT_ENV = "ONLINERL_BENCH_PASSTHROUGH_PORT"
MAX_BODY = 1 << 20


def passthrough_app(engine: InProcessEngine) -> ASGIApp:
    """POST /v1/completions handed to vLLM's app as the gateway hands it (``post_whole`` for a whole answer, ``post``
    and the chunks relayed for a stream); GET /readyz answers 200 once the server runs."""

    async def send_whole(send: Send, status: int, body: bytes) -> None:
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == "/readyz":
            await send_whole(send, 200, b"{}")
            return
        body = await read_capped(receive, MAX_BODY, lambda: ValueError("body too large"), ConnectionError)
        if not orjson.loads(body).get("stream"):
            resp = await engine.post_whole("/v1/completions", body, receive)
            answer = await resp.read()
            await resp.aclose()
            await send_whole(send, resp.status_code, answer)
            return
        resp = await engine.post("/v1/completions", body)
        try:
            headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
            await send({"type": "http.response.start", "status": resp.status_code, "headers": headers})
            async for data in resp.chunks():
                await send({"type": "http.response.body", "body": data, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await resp.aclose()

    return app


class PassthroughGateway(InProcessGateway):
    """The in-process gateway, plus the pass-through on ``$ONLINERL_BENCH_PASSTHROUGH_PORT`` in the same loop."""

    def __init__(self, app: ASGIApp, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._passthrough: Any = None
        self._passthrough_task: asyncio.Task | None = None

    async def start(self, lifespan_scope: Scope) -> None:
        await super().start(lifespan_scope)
        assert self.engine is not None
        port = int(os.environ[PORT_ENV])
        self._passthrough = server_in_this_loop(passthrough_app(self.engine), "127.0.0.1", port, lifespan="off")
        self._passthrough_task = asyncio.ensure_future(self._passthrough._serve())  # not serve(): vLLM owns signals
        for _ in range(1500):
            if self._passthrough.started or self._passthrough_task.done():
                break
            await asyncio.sleep(0.02)
        if not self._passthrough.started:
            raise RuntimeError(f"the pass-through did not start on port {port}")

    async def stop(self) -> None:
        if self._passthrough is not None and self._passthrough_task is not None:
            self._passthrough.should_exit = True
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(self._passthrough_task, 30)
        await super().stop()
