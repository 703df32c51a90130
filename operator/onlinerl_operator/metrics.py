"""The operator's own /healthz and /metrics on :8080 (docs/architecture.md), served inside kopf's event loop."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, Counter, generate_latest

RECONCILES = Counter("onlinerl_operator_reconciles_total", "Reconcile passes", ["kind", "result"])


async def serve_health_and_metrics(port: int, host: str = "0.0.0.0") -> web.AppRunner:
    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
