"""HTTP layer of the feedback service: ``POST /api/training/submit`` plus health, readiness and metrics.

Order of checks, cheapest first, so a stranger never makes us read or parse a body: declared size (413), bearer key
(401), project (403), streamed size (413), JSON and fields (422), backlog (429), then the Redis work (503 when Redis
does not answer). Every reply carries ``status``; errors also carry the OpenAI-style ``error`` object.
A 200 is sent only after Redis acknowledged the append (see store.py).
"""

from __future__ import annotations

import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from starlette.requests import ClientDisconnect

from onlinerl.auth import KeyRing, bearer_token
from onlinerl.config import OnlineRLConfig
from onlinerl.keys import Keys
from onlinerl.schemas import CompletionOutcome

from .backlog import BacklogMonitor
from .decide import ACCEPTED, DUPLICATE, REJECTED, UNMATCHED, decide
from .metrics import FeedbackMetrics
from .pipeliner import Pipeliner, RedisUnavailable
from .prompts import configured_template, event_prompt
from .store import FeedbackStore

log = logging.getLogger("onlinerl_feedback")

SUBMIT_PATH = "/api/training/submit"
PROJECT_HEADER = "x-project-id"
UNKNOWN_TENANT = "unknown"


class Reject(Exception):
    """A request we refuse: HTTP code, machine reason, and a message that says what to fix."""

    def __init__(
        self,
        code: int,
        reason: str,
        message: str,
        param: str | None = None,
        retry_after: bool = False,
        tenant: str = UNKNOWN_TENANT,
    ) -> None:
        super().__init__(message)
        self.code, self.reason, self.message, self.param = code, reason, message, param
        self.retry_after, self.tenant = retry_after, tenant


_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


@dataclass
class Deps:
    """What the handlers need, built in the lifespan (one Redis client and pipeliner per process)."""

    store: FeedbackStore
    monitor: BacklogMonitor
    client: Redis


def redis_client(url: str, connect_timeout: float = 0.5, timeout: float = 2.0) -> Redis:
    """Small timeouts and no silent retries: an unreachable Redis must turn into a fast 503, not a hang."""
    return Redis.from_url(
        url,
        socket_connect_timeout=connect_timeout,
        socket_timeout=timeout,
        retry=Retry(NoBackoff(), 0),
        max_connections=16,
    )


async def read_capped(request: Request, cap: int) -> bytes:
    """The body, refusing to buffer more than ``cap`` bytes whatever Content-Length claimed (chunked uploads)."""
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > cap:
                raise Reject(413, "body_too_large", f"request body exceeds feedback.maxBodyBytes={cap} bytes")
            chunks.append(chunk)
    except ClientDisconnect:
        raise Reject(
            400, "client_disconnected", "the client closed the connection before the body was complete"
        ) from None
    return b"".join(chunks)


def parse_event(body: bytes) -> CompletionOutcome:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise Reject(422, "invalid_json", f"body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise Reject(422, "invalid_body", "body must be a JSON object (Continue's AutocompleteOutcome)")
    try:
        return CompletionOutcome.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "body"
        raise Reject(422, "invalid_field", f"field {field!r}: {first['msg']}", param=field) from None


def create_app(cfg: OnlineRLConfig, keyring: KeyRing, redis_url: str) -> FastAPI:
    fb = cfg.feedback
    keys = Keys(cfg.job)
    metrics = FeedbackMetrics()
    template = configured_template(cfg)
    retry_after = {"Retry-After": str(fb.retry_after_seconds)}
    deps: Deps | None = None

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        nonlocal deps
        client = redis_client(redis_url, connect_timeout=min(cfg.redis.connect_timeout_seconds, 0.5))
        reads, writes = Pipeliner(client), Pipeliner(client)
        monitor = BacklogMonitor(client, keys, metrics)
        reads.start()
        writes.start()
        await monitor.refresh()
        monitor.start()
        deps = Deps(FeedbackStore(reads, writes, keys, fb.dedupe_ttl_seconds), monitor, client)
        app.state.deps = deps
        try:
            yield
        finally:
            await monitor.close()
            await writes.close()
            await reads.close()
            await client.aclose()

    app = FastAPI(title="onlinerl feedback", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.metrics = metrics

    def reply(code: int, body: dict, headers: dict | None = None) -> Response:
        metrics.responses.labels(str(code)).inc()
        return Response(orjson.dumps(body), status_code=code, media_type="application/json", headers=headers)

    def refuse(r: Reject) -> Response:
        metrics.events.labels(REJECTED, r.tenant).inc()
        body = {
            "status": REJECTED,
            "reason": r.reason,
            "error": {
                "message": r.message,
                "type": _ERROR_TYPES.get(r.code, "invalid_request_error"),
                "param": r.param,
                "code": r.reason,
            },
        }
        return reply(r.code, body, retry_after if r.retry_after else None)

    def authenticate(request: Request) -> str:
        tenant = keyring.tenant_for(bearer_token(request.headers.get("authorization")))
        if tenant is None:
            raise Reject(401, "unauthorized", "missing or unknown API key: send `Authorization: Bearer <key>`")
        project = request.headers.get(PROJECT_HEADER)
        if not project:
            raise Reject(
                403,
                "missing_project",
                "header X-Project-ID is required and must name your project (Continue: completionTrackingHeaders)",
                tenant=tenant,
            )
        if project != tenant:
            raise Reject(
                403, "wrong_project", "this API key does not belong to the project in X-Project-ID", tenant=tenant
            )
        return tenant

    async def handle(request: Request) -> Response:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > fb.max_body_bytes:
            raise Reject(
                413,
                "body_too_large",
                f"request body exceeds feedback.maxBodyBytes={fb.max_body_bytes} bytes (Content-Length {declared})",
            )
        tenant = authenticate(request)
        try:
            event = parse_event(await read_capped(request, fb.max_body_bytes))
        except Reject as r:
            r.tenant = tenant
            raise
        assert deps is not None
        if deps.monitor.backlog > fb.max_backlog:
            raise Reject(
                429,
                "backlog_full",
                f"{deps.monitor.backlog} unconsumed samples exceed feedback.maxBacklog={fb.max_backlog}; retry later",
                retry_after=True,
                tenant=tenant,
            )
        prompt = event_prompt(event, template)
        try:
            records = await deps.store.rollouts(tenant, prompt)
            decision = decide(event, tenant, prompt, records, fb)
            result = await deps.store.append(tenant, event.completion_id, decision)
        except (RedisUnavailable, RedisError, OSError) as exc:
            log.warning("redis unavailable: %s", exc)
            raise Reject(
                503,
                "redis_unavailable",
                "event store unavailable, nothing was recorded; retry later",
                retry_after=True,
                tenant=tenant,
            ) from None
        body = {"completion_id": event.completion_id, "tenant": tenant}
        if not result.new:
            metrics.events.labels(DUPLICATE, tenant).inc()
            return reply(
                200, {"status": DUPLICATE, **body, "first_outcome": result.outcome, "entry_id": result.entry_id}
            )
        metrics.events.labels(decision.status, tenant).inc()
        if decision.status == UNMATCHED or (decision.status == ACCEPTED and decision.reason):
            metrics.join_misses.labels(decision.reason).inc()
        if "shown" in decision.stats:
            labels = (str(decision.version), decision.arm)
            metrics.shown.labels(*labels).inc()
            if "accepted" in decision.stats:
                metrics.accepted.labels(*labels).inc()
        id_field = "sample_id" if decision.to_samples else "audit_id"
        out = {"status": decision.status, **body, id_field: result.entry_id, **decision.details}
        if decision.reason:
            out["reason"] = decision.reason
        return reply(200, out)

    @app.post(SUBMIT_PATH)
    async def submit(request: Request) -> Response:
        started = time.perf_counter()
        try:
            return await handle(request)
        except Reject as r:
            return refuse(r)
        finally:
            metrics.duration.observe(time.perf_counter() - started)

    @app.get("/healthz")
    async def healthz() -> Response:
        return Response(b'{"status":"ok"}', media_type="application/json")

    @app.get("/readyz")
    async def readyz() -> Response:
        try:
            assert deps is not None
            await deps.client.ping()
        except (RedisError, OSError, AssertionError) as exc:
            return Response(
                orjson.dumps({"status": "unavailable", "reason": f"redis: {exc}"}),
                status_code=503,
                media_type="application/json",
                headers=retry_after,
            )
        return Response(b'{"status":"ready"}', media_type="application/json")

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
