"""Apps beside the in-process gateway, in vLLM's process, for `bench/serving_latency.py --in-process` (issue 40).

vLLM loads :class:`BenchGateway` as its ``--middleware``: it starts the real in-process gateway exactly as
``onlinerl_serving.inprocess.InProcessGateway`` does, and beside it, in the same event loop, whichever of these the
environment names a port for. Each is timed on the same vLLM, in the same interleaved rounds as the gateway:

- ``$ONLINERL_BENCH_PASSTHROUGH_PORT`` (``--passthrough``): an app with the gateway's plumbing and none of its work.
  It hands the body it gets to vLLM (``InProcessEngine``, as the gateway does) unchanged and writes back what vLLM
  answers. Timed with the gateway's own upstream body:

      pass-through - direct+cap   the plumbing;
      gateway - pass-through      the gateway's own work, inside vLLM's process.

- ``$ONLINERL_BENCH_ROUTE_PORT`` (``--ab-direct``): the real gateway a second time, whose engine client never calls
  vLLM's completion handler directly (``InProcessEngine.direct`` unset): every request goes through vLLM's HTTP
  route, as before onlinerl_serving/vllm_completions.py. Gateway against this one: what the direct call saves, before
  and after in one run.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from typing import Any

import orjson

from onlinerl.asgi import ASGIApp, Receive, Scope, Send, read_capped
from onlinerl.config import OnlineRLConfig, load_config
from onlinerl_serving.inprocess import InProcessEngine, InProcessGateway, server_in_this_loop

PORT_ENV = "ONLINERL_BENCH_PASSTHROUGH_PORT"
ROUTE_PORT_ENV = "ONLINERL_BENCH_ROUTE_PORT"
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


def route_only_gateway(cfg: OnlineRLConfig, engine: InProcessEngine, port: int) -> ASGIApp:
    """The real gateway on ``port``, configured as the in-process one (``cfg``), over a client of the same vLLM app
    that never calls its completion handler directly."""
    from onlinerl_serving.gateway import create_app

    data = cfg.dump()
    data["serving"]["port"] = port
    cfg = OnlineRLConfig.model_validate(data)
    route_only = InProcessEngine(engine.app, read_timeout=engine.read_timeout)
    route_only.app_scope = engine.app_scope  # direct stays None
    return create_app(cfg, engine=route_only)


class BenchGateway(InProcessGateway):
    """The in-process gateway, plus the pass-through and the route-only gateway where their ports are set."""

    def __init__(self, app: ASGIApp, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._beside: list[tuple[Any, asyncio.Task]] = []

    async def start(self, lifespan_scope: Scope) -> None:
        await super().start(lifespan_scope)
        assert self.engine is not None
        apps = []
        if PORT_ENV in os.environ:
            apps.append((passthrough_app(self.engine), int(os.environ[PORT_ENV]), "off"))
        if ROUTE_PORT_ENV in os.environ:
            port = int(os.environ[ROUTE_PORT_ENV])
            cfg = (self.config_loader or load_config)()
            apps.append((route_only_gateway(cfg, self.engine, port), port, "on"))
        for app, port, lifespan in apps:
            server = server_in_this_loop(app, "127.0.0.1", port, lifespan=lifespan)
            task = asyncio.ensure_future(server._serve())  # not serve(): vLLM owns the signals
            self._beside.append((server, task))
            for _ in range(1500):
                if server.started or task.done():
                    break
                await asyncio.sleep(0.02)
            if not server.started:
                raise RuntimeError(f"the bench app did not start on port {port}")

    async def stop(self) -> None:
        for server, task in self._beside:
            server.should_exit = True
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(task, 30)
        await super().stop()
