"""HTTP layer of the feedback service: ``POST /api/training/submit`` (the AutocompleteOutcome itself: the fork's
``completionTrackingUrl``, our simulator) and ``POST /api/training/data`` (stock Continue's ``data:`` destination: the
same outcome inside Continue's dev-data envelope, envelope.py), plus health, readiness and metrics.

The two upload routes are plain ASGI in front of the FastAPI app (``onlinerl.asgi.with_hot_route``): it is the only hot
path, and FastAPI's middleware stack, request object and dependency solving cost about a quarter of the server's CPU
per event there (py-spy, bench/feedback_load.py). Everything else (health, metrics, 404/405) stays FastAPI.

Order of checks, cheapest first, so a stranger never makes us read or parse a body: declared size (413), bearer key
(401), project (403: only when ``X-Project-ID`` names another project than the key's; without the header the key's
own project is used, since a key belongs to one project), streamed size (413), JSON and fields (422), backlog (429),
then the Redis work (503 when Redis does not answer). Every reply carries ``status``; errors also carry the
OpenAI-style ``error`` object. A 200 is sent only after Redis acknowledged the append (see store.py).
"""

from __future__ import annotations

import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

import orjson
from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from onlinerl.asgi import Receive, Scope, Send, read_capped, with_hot_route
from onlinerl.auth import KeyRing, bearer_token, reveals_routing
from onlinerl.config import OnlineRLConfig
from onlinerl.http_errors import error_object, error_type
from onlinerl.keys import Keys, prompt_digest
from onlinerl.schemas import AuditEntry, CompletionOutcome
from onlinerl.secret_scan import FieldFinding, scan_fields
from onlinerl.tokens import TokenTable

from .backlog import BacklogMonitor
from .decide import ACCEPTED, AUDIT_TEXT_LIMIT, CONTRIBUTION_LIMIT, DUPLICATE, REJECTED, UNMATCHED, decide
from .envelope import Envelope, EnvelopeError, Kind, parse_envelope
from .limits import user_of
from .metrics import FeedbackMetrics
from .openapi import DATA_PATH, SUBMIT_PATH, openapi_document
from .pipeliner import Pipeliner, RedisUnavailable
from .prompts import configured_template, event_prompt
from .raters import rater_of
from .retention import AuditRetention
from .store import FeedbackStore
from .sweeper import SilenceSweeper, silence_counter

log = logging.getLogger("onlinerl_feedback")

PROJECT_HEADER = b"x-project-id"
UNKNOWN_TENANT = "unknown"
# Reply fields only eval and admin keys get: a user who learns which version (so which arm) served it can steer the
# canary it is in (issue 35); the gateway hides its arm and version headers from user keys for the same reason.
REVEALED_ONLY = frozenset({"policy_version"})
IGNORED = "ignored"  # a Continue event that is not an autocomplete outcome: counted by name, nothing written
WARNED_SCHEMAS_MAX = 64  # unknown schema versions warned about once each; a client picks them, so the set is capped


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


async def read_body(receive: Receive, cap: int) -> bytes:
    """The body, at most ``cap`` bytes (``onlinerl.asgi.read_capped``), refused with feedback's own reasons."""
    return await read_capped(
        receive,
        cap,
        lambda: Reject(413, "body_too_large", f"request body exceeds feedback.maxBodyBytes={cap} bytes"),
        lambda: Reject(400, "client_disconnected", "the client closed the connection before the body was complete"),
    )


_SUBMIT_HEADERS = frozenset((b"content-length", b"authorization", PROJECT_HEADER))


def request_headers(scope: Scope) -> dict[bytes, bytes]:
    """The few headers the submit path reads; ASGI servers hand header names over lower-cased."""
    return {name: value for name, value in scope["headers"] if name in _SUBMIT_HEADERS}


def parse_event(body: bytes) -> CompletionOutcome:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise Reject(422, "invalid_json", f"body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise Reject(422, "invalid_body", "body must be a JSON object (Continue's AutocompleteOutcome)")
    return outcome_of(data)


def outcome_of(data: dict, where: str = "") -> CompletionOutcome:
    """``data`` as an AutocompleteOutcome, or a 422 naming the field at fault (``where``: its path's prefix)."""
    try:
        return CompletionOutcome.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        field = where + (".".join(str(p) for p in first["loc"]) or "body")
        raise Reject(422, "invalid_field", f"field {field!r}: {first['msg']}", param=field) from None


def parse_data_envelope(body: bytes) -> Envelope:
    try:
        return parse_envelope(body)
    except EnvelopeError as exc:
        raise Reject(422, exc.reason, exc.message, param=exc.param) from None


def envelope_audit_entry(env: Envelope, tenant: str, reason: str, sender: str = "", screen: bool = True) -> bytes:
    """The audit record of an envelope that is never trained (no code, unknown schema): what it was, and why.
    ``sender``: the key's user hash (`onlinerl forget`); ``screen``: a completion holding a credential is not kept."""
    completion = env.data.get("completion")
    prompt = env.data.get("prompt")
    if screen and isinstance(completion, str) and scan_fields([("completion", completion[:AUDIT_TEXT_LIMIT])]):
        completion = ""
    return AuditEntry(
        event_id=env.completion_id or env.name[:64],
        tenant=tenant,
        outcome=REJECTED,
        reason=reason,
        accepted=env.accepted,
        completion=completion[:AUDIT_TEXT_LIMIT] if isinstance(completion, str) else "",
        prompt_digest=prompt_digest(prompt) if isinstance(prompt, str) else "",
        received_at=time.time(),
        user_hash=sender,
    ).to_json()


def create_app(cfg: OnlineRLConfig, keyring: KeyRing, redis_url: str, table: TokenTable) -> FastAPI:
    fb = cfg.feedback
    keys = Keys(cfg.job)
    metrics = FeedbackMetrics()
    silenced = silence_counter(metrics.registry)  # onlinerl_feedback_silence_total{result}
    template = configured_template(cfg)

    def screen_event(prompt: str, completion: str) -> list[FieldFinding]:
        """privacy.secretScreening on the event itself (the gateway screened what it served; this catches what it
        did not, e.g. records written with screening off), counted by kind; never logged."""
        if cfg.privacy.secret_screening == "off":
            return []
        findings = scan_fields([("prompt", prompt), ("completion", completion)])
        for f in findings:
            metrics.secret_findings.labels(f.kind, f.field).inc()
        return findings

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
        sweeper = SilenceSweeper(client, keys, fb, silenced)  # starts only if a tenant has silence on
        sweeper.start()
        # issue 38. Its own client: on the shared one, the submit path kept failing after a Redis restart
        # (tests/feedback/test_durability.py; the pipeliners take their connections from that pool).
        retention_client = redis_client(redis_url, connect_timeout=min(cfg.redis.connect_timeout_seconds, 0.5))
        retention = AuditRetention(retention_client, keys, cfg.privacy.retention.audit_seconds)
        retention.start()
        store = FeedbackStore(reads, writes, keys, fb.dedupe_ttl_seconds, cfg.redis.rollout_ttl_seconds, fb.limits)
        deps = Deps(store, monitor, client)
        app.state.deps = deps
        try:
            yield
        finally:
            await retention.close()
            await retention_client.aclose()
            await sweeper.close()
            await monitor.close()
            await writes.close()
            await reads.close()
            await client.aclose()

    app = FastAPI(title="onlinerl feedback", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.metrics = metrics

    retry_after_header = [(b"retry-after", str(fb.retry_after_seconds).encode())]

    async def reply(send: Send, code: int, body: dict, extra: list[tuple[bytes, bytes]] | None = None) -> None:
        metrics.responses.labels(str(code)).inc()
        payload = orjson.dumps(body)
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
        await send({"type": "http.response.start", "status": code, "headers": headers + (extra or [])})
        await send({"type": "http.response.body", "body": payload})

    async def refuse(send: Send, r: Reject) -> None:
        metrics.events.labels(REJECTED, r.tenant).inc()
        body = {
            "status": REJECTED,
            "reason": r.reason,
            "error": error_object(r.message, type_=error_type(r.code), param=r.param, code=r.reason),
        }
        await reply(send, r.code, body, retry_after_header if r.retry_after else None)

    def authenticate(headers: dict[bytes, bytes]) -> tuple[str, str, bool]:
        """``(tenant, user, reveal)``: the user is the API key's id (limits.py), never anything the client says;
        ``reveal``: the key may see the policy version it rated (eval and admin keys; never a user key)."""
        authorization = headers.get(b"authorization")
        identity = keyring.identity_for(bearer_token(authorization.decode("latin-1") if authorization else None))
        if identity is None:
            raise Reject(401, "unauthorized", "missing or unknown API key: send `Authorization: Bearer <key>`")
        tenant = identity.tenant
        project = headers.get(PROJECT_HEADER)  # optional: a key belongs to one project, which it names by itself
        if project and project.decode("latin-1") != tenant:
            raise Reject(
                403, "wrong_project", "this API key does not belong to the project in X-Project-ID", tenant=tenant
            )
        return tenant, user_of(identity.key_id), reveals_routing(identity, cfg.serving.routing_headers)

    async def admit(scope: Scope, receive: Receive) -> tuple[dict[bytes, bytes], str, str, bool, bytes]:
        """The checks both upload routes share, up to the body: ``(headers, tenant, user, reveal, body)``."""
        headers = request_headers(scope)
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > fb.max_body_bytes:
            raise Reject(
                413,
                "body_too_large",
                f"request body exceeds feedback.maxBodyBytes={fb.max_body_bytes} bytes "
                f"(Content-Length {declared.decode()})",
            )
        tenant, user, reveal = authenticate(headers)
        try:
            return headers, tenant, user, reveal, await read_body(receive, fb.max_body_bytes)
        except Reject as r:
            r.tenant = tenant
            raise

    async def handle(scope: Scope, receive: Receive, send: Send) -> None:
        headers, tenant, user, reveal, body = await admit(scope, receive)
        try:
            event = parse_event(body)
        except Reject as r:
            r.tenant = tenant
            raise
        await record(send, headers, event, tenant, user, reveal)

    def redis_down(exc: Exception, tenant: str) -> Reject:
        log.warning("redis unavailable: %s", exc)
        return Reject(
            503,
            "redis_unavailable",
            "event store unavailable, nothing was recorded; retry later",
            retry_after=True,
            tenant=tenant,
        )

    warned_schemas: set[str] = set()

    async def handle_envelope(scope: Scope, receive: Receive, send: Send) -> None:
        """Stock Continue's dev-data upload: an autocomplete outcome at level all is recorded exactly as the direct
        upload (same reply); a noCode outcome or an unknown schema is audited and answered 200; any other event is
        counted by name and answered 200 (envelope.py says why every one of them must get a 2xx)."""
        headers, tenant, user, reveal, body = await admit(scope, receive)
        try:
            env = parse_data_envelope(body)
            kind = env.kind
            event = outcome_of(env.data, "data.") if kind is Kind.OUTCOME else None
        except Reject as r:
            r.tenant = tenant
            raise
        metrics.continue_events.labels(env.name_label, env.schema_label).inc()
        if event is not None:
            return await record(send, headers, event, tenant, user, reveal)
        if kind is Kind.IGNORED:
            return await reply(send, 200, {"status": IGNORED, "name": env.name_label, "tenant": tenant})
        new_schema = env.schema not in warned_schemas and len(warned_schemas) < WARNED_SCHEMAS_MAX
        if kind is Kind.UNKNOWN_SCHEMA and new_schema:
            warned_schemas.add(env.schema)
            log.warning(
                "Continue sent dev-data schema %r (known: 0.1.0, 0.2.0): its events are audited, not trained; "
                "a Continue upgrade may need a new parser",
                env.schema[:64],
            )
        assert deps is not None
        try:
            sender = rater_of(headers.get(b"authorization"), "user") or ""
            screening = cfg.privacy.secret_screening != "off"
            audit_id = await deps.store.audit(envelope_audit_entry(env, tenant, kind.value, sender, screening))
        except (RedisUnavailable, RedisError, OSError) as exc:
            raise redis_down(exc, tenant) from None
        metrics.events.labels(REJECTED, tenant).inc()
        out = {"status": REJECTED, "reason": kind.value, "tenant": tenant, "audit_id": audit_id, "name": env.name_label}
        if env.completion_id:
            out["completion_id"] = env.completion_id
        await reply(send, 200, out)

    async def record(
        send: Send, headers: dict[bytes, bytes], event: CompletionOutcome, tenant: str, user: str, reveal: bool
    ) -> None:
        """Join, decide and append one outcome, and reply: what both upload routes do with an outcome."""
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
        secrets = screen_event(prompt, event.completion)  # a credential: audited without text, never trained
        sender = rater_of(headers.get(b"authorization"), "user") or ""
        try:
            found = await deps.store.rollouts(tenant, prompt)
            rater = rater_of(headers.get(b"authorization"), fb.rate_scope)
            decision = decide(
                event,
                tenant,
                prompt,
                found.records,
                fb,
                rated=found.rated,
                table=table,
                rater=rater,
                secrets=secrets,
                sender=sender,
            )
            if secrets:  # what the store may still audit (a duplicate delivery) never holds the text
                event = event.model_copy(update={"completion": "", "prompt": "", "prefix": "", "suffix": ""})
            result = await deps.store.append(event, tenant, prompt, decision, user, sender)
        except (RedisUnavailable, RedisError, OSError) as exc:
            raise redis_down(exc, tenant) from None
        body = {"completion_id": event.completion_id, "tenant": tenant}
        if not result.new:
            metrics.events.labels(DUPLICATE, tenant).inc()
            first = {"status": DUPLICATE, **body, **result.duplicate_fields()}
            if "rollout_id" in decision.details:
                first["rollout_id"] = decision.details["rollout_id"]
            return await reply(send, 200, first)
        if result.limited:  # the user may not contribute now: audited, not trained, not counted (limits.py)
            metrics.events.labels(REJECTED, tenant).inc()
            (metrics.limited if result.reason == CONTRIBUTION_LIMIT else metrics.quarantined).labels(tenant).inc()
            out = {"status": REJECTED, **body, "audit_id": result.entry_id, "reason": result.reason}
            if "rollout_id" in decision.details:
                out["rollout_id"] = decision.details["rollout_id"]
            return await reply(send, 200, out)
        if result.quarantined_now:
            metrics.users_quarantined.labels(tenant).inc()
            log.warning("tenant %s: user %s quarantined (accept rate far above or below the tenant's)", tenant, user)
        metrics.events.labels(decision.status, tenant).inc()
        if decision.status == UNMATCHED or (decision.status == ACCEPTED and decision.reason):
            metrics.join_misses.labels(decision.reason).inc()
        if decision.version is not None:  # it rated a rollout of its own or the shared line: counted on that line
            metrics.rated(decision.line, decision.status, decision.version, decision.arm, decision.stats)
            if decision.to_samples:
                metrics.rewarded(decision.line, float(decision.details.get("reward", 0.0)))
        id_field = "sample_id" if decision.to_samples else "audit_id"
        details = decision.details if reveal else {k: v for k, v in decision.details.items() if k not in REVEALED_ONLY}
        out = {"status": decision.status, **body, id_field: result.entry_id, **details}
        if decision.reason:
            out["reason"] = decision.reason
        await reply(send, 200, out)

    def route(handler):
        async def serve(scope: Scope, receive: Receive, send: Send) -> None:
            started = time.perf_counter()
            try:
                await handler(scope, receive, send)
            except Reject as r:
                await refuse(send, r)
            finally:
                metrics.duration.observe(time.perf_counter() - started)

        return serve

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

    schema = orjson.dumps(openapi_document(fb.max_body_bytes))  # hand-written: the submit route is raw ASGI

    @app.get("/openapi.json")
    async def openapi() -> Response:
        return Response(schema, media_type="application/json")

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    hot = with_hot_route(app, "POST", SUBMIT_PATH, route(handle))
    return with_hot_route(hot, "POST", DATA_PATH, route(handle_envelope))
