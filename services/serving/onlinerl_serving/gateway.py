"""The gateway: OpenAI ``/v1/completions`` in front of vLLM, with auth, limits, policy routing and rollout capture.

``python -m onlinerl_serving.gateway`` (config from :func:`onlinerl.config.load_config`). The completions route is a
raw ASGI app: it decides the status only after vLLM answered, relays the SSE stream chunk by chunk (stripping what the
client did not ask for while keeping token ids and log-probs for the record), sends the rollout record's write to
Redis before the client's ``data: [DONE]``, and aborts the upstream request as soon as the client goes away.

Per-project adapters (issue 39): a key is routed on its project's own policy line when the project has one loaded
here (``ServingState.lines``: the project is the key's tenant, never anything the client sends), with that line's
table and the same routing rules; else on the shared line. ``X-Project-ID`` naming another project than the key's is
refused (403 ``wrong_project``, as the feedback service does); body fields (``model``, ``user``, anything else) never
choose a line or an adapter. A line that promoted nothing yet (stable 0) is routed while it runs its first canary:
its candidate arm gets the line's candidate, its stable arm the shared stable, recorded as the line's v0 (the
project's baseline, what it was served until now). An evaluation key asks for a version of its own project's line with
``X-OnlineRL-Line: <its project>`` beside ``X-OnlineRL-Version`` (default: the shared line). The record carries the
line, the line's version and the adapter that served it; ``served`` counts on that line's stats.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid
from collections import Counter as Tally
from collections.abc import Coroutine
from typing import Any

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from onlinerl.arms import CANDIDATE, EVAL, PINNED, STABLE, Arm
from onlinerl.asgi import ASGIApp, Receive, Scope, Send, read_capped, serve, with_hot_route
from onlinerl.auth import KeyRing, bearer_token, reveals_routing
from onlinerl.config import OnlineRLConfig, load_config
from onlinerl.http_errors import error_body
from onlinerl.keys import SHARED_LINE, Keys
from onlinerl.lines import adapter_name
from onlinerl.schemas import PolicyTable
from onlinerl_serving.capture import RolloutAccumulator, RolloutStore, client_view
from onlinerl_serving.errors import ApiError, engine_timeout, pin_forbidden, unauthorized, unavailable, wrong_project
from onlinerl_serving.metrics import GatewayMetrics
from onlinerl_serving.openapi import openapi_document
from onlinerl_serving.requests import (
    CompletionRequest,
    Limits,
    parse_completion_request,
    sampling_record,
    upstream_body,
    with_exploration,
)
from onlinerl_serving.routing import Route as PolicyRoute
from onlinerl_serving.routing import choose, newest_loaded_at_most, route, served_model_name, user_hash
from onlinerl_serving.screening import SecretScreen
from onlinerl_serving.state import ServingState
from onlinerl_serving.upstream import Engine, EnginePool, EngineResponse, EngineTimeout, EngineUnavailable
from onlinerl_serving.weights_gate import WeightsUnknown, weights_endpoint

log = logging.getLogger("onlinerl.gateway")


LOOPBACK = {"127.0.0.1", "::1", "localhost"}
# Evaluation asks for one version explicitly (`onlinerl eval`, the rollout gate); recorded under arm "eval".
VERSION_HEADER = b"x-onlinerl-version"
# ...of its own project's line (issue 39; absent or empty: the shared line).
LINE_HEADER = b"x-onlinerl-line"
# Continue's project header (feedback reads it too): when sent, it must name the key's own project.
PROJECT_HEADER = b"x-project-id"


def _header(scope: Scope, name: bytes) -> str | None:
    for k, v in scope["headers"]:
        if k == name:
            return v.decode("latin-1")
    return None


def _forced_version(scope: Scope) -> int | None:
    raw = _header(scope, VERSION_HEADER)
    if raw is None:
        return None
    text = raw.strip()
    # ASCII digits only: str.isdigit() also takes latin-1 "²", which int() refuses (a 500 found by tests/fuzz)
    if not (text.isascii() and text.isdigit()) or len(text) > 18:
        raise ApiError(
            400,
            f"X-OnlineRL-Version must be a non-negative integer (at most 18 digits), got {raw[:40]!r}",
            param="X-OnlineRL-Version",
        )
    return int(text)


def _own_project_only(scope: Scope, tenant: str) -> str:
    """The line an evaluation's ``X-OnlineRL-Line`` asks for ('' when absent). ``X-Project-ID`` and
    ``X-OnlineRL-Line``, when they name a project, must name the key's own: 403 ``wrong_project`` otherwise."""
    line = ""
    for k, v in scope["headers"]:  # one pass; most requests carry neither header
        if k in (PROJECT_HEADER, LINE_HEADER):
            named = v.decode("latin-1").strip()
            if named and named != tenant:
                raise wrong_project("X-Project-ID" if k == PROJECT_HEADER else "X-OnlineRL-Line", named, tenant)
            if k == LINE_HEADER:
                line = named
    return line


def api_key_of(scope: Scope) -> str | None:
    """Continue sends the key twice (``Authorization: Bearer`` and ``api-key``); either one is enough."""
    return bearer_token(_header(scope, b"authorization")) or (_header(scope, b"api-key") or "").strip() or None


class Gateway:
    """Everything one gateway process holds: config, key ring, clients, cached state, metrics, in-flight counts."""

    def __init__(
        self, cfg: OnlineRLConfig, keyring: KeyRing, redis: Any, pool: Engine, metrics: GatewayMetrics | None = None
    ) -> None:
        self.cfg = cfg
        self.keyring = keyring
        self.redis = redis
        self.pool = pool  # this pod's vLLM: keep-alive connections, or its app in this process (inprocess.py)
        self.keys = Keys(cfg.job)
        self.metrics = metrics or GatewayMetrics()
        self.limits = Limits(
            cfg.serving.max_prompt_chars,
            cfg.serving.max_tokens_cap,
            cfg.model.max_model_len,
            cfg.serving.default_max_tokens,
        )
        self.max_body = cfg.serving.max_body_bytes
        self.state = ServingState(
            redis=redis,
            keys=self.keys,
            engine=pool,
            job=cfg.job,
            base_name=cfg.model.served_name,
            weights_mode=cfg.serving.weights_mode,
            projects=cfg.projects,
        )
        self.inflight: Tally[str] = Tally()
        self._held_arm: tuple[int, Arm] = (-1, STABLE)  # full weights: (held version, arm it was last routed under)
        self.rollouts = RolloutStore(
            redis,
            self.keys,
            cfg.redis.rollout_ttl_seconds,
            cfg.feedback.silence,
            cfg.serving.max_records_per_tenant,
            self.metrics.records_evicted,
        )
        self.screen = SecretScreen(cfg.privacy.secret_screening, self.metrics.registry)  # issue 38

    # --- routing ------------------------------------------------------------------------------------------------
    def pick(
        self,
        uhash: str,
        forced: int | None = None,
        held: int | None = None,
        tenant: str = "",
        forced_line: str = SHARED_LINE,
    ) -> tuple[PolicyRoute, str, str, PolicyTable]:
        """``(route, served model, line, the line's table)`` of one request. ``held``: full-weight mode, the version
        vLLM's one model holds while this request is in flight. ``tenant``: the key's project, routed on its own line
        when it has one here (one dict lookup); ``forced_line``: the line an evaluation's version is on."""
        table = self.state.policy
        line = SHARED_LINE
        draw = random.random()  # this request's point when a few-user canary splits by request (routing.choose)
        if forced is not None:
            line = forced_line if held is None else SHARED_LINE  # full weights hold one model: no project lines
            r = self._forced_route(forced, held, line)
        elif held is not None:
            # Full weights: everyone gets what vLLM holds. While the table already names another version (a switch
            # is coming), the held one keeps the arm it was last routed under: the old stable stays "stable", and a
            # blue/green candidate being switched back stays "candidate", never counted in a stable arm.
            arm, wanted = choose(table, uhash, draw)
            if wanted == held:
                self._held_arm = (held, arm)
            else:
                arm = self._held_arm[1] if self._held_arm[0] == held else STABLE
            r = PolicyRoute(arm, held, wanted)
        else:
            own = self.state.lines.get(tenant)  # the project's own line, when it has one routable here
            if own is not None:
                line, table = tenant, own.table
                r = route(table, uhash, own.loaded, draw)
                if r.version == 0 and table.stable == 0 and r.arm != PINNED:
                    # The line promoted nothing yet (its first canary): v0 of the line is what the project is served
                    # now, the shared stable; counted on the line's stable arm (v0), recorded with the shared model.
                    shared = newest_loaded_at_most(self.state.policy.stable, self.state.loaded_versions())
                    return r, self.model_for(SHARED_LINE, shared), line, table
            else:
                r = route(table, uhash, self.state.loaded_versions(), draw)
        return r, self.model_for(line, r.version), line, table

    def model_for(self, line: str, version: int) -> str:
        """The vLLM model that serves ``version`` of ``line`` (0 of any line: the base model)."""
        if line and version:
            return adapter_name(self.cfg.job, version, line)
        return served_model_name(self.cfg.job, self.cfg.model.served_name, version, self.cfg.serving.weights_mode)

    def _forced_route(self, version: int, held: int | None = None, line: str = SHARED_LINE) -> PolicyRoute:
        """The version an evaluation asked for, if this replica serves it (else 409: nothing is substituted)."""
        available = {held} if held is not None else self.state.line_versions(line)
        if version not in available:
            where = f" of project {line}'s line" if line else ""
            raise ApiError(
                409,
                f"policy version {version}{where} is not loaded in this replica (loaded: "
                f"{sorted(available)}); drop the X-OnlineRL-Version header to be routed",
                code="version_not_loaded",
                param="X-OnlineRL-Version",
            )
        return PolicyRoute(EVAL, version, version)

    # --- ASGI entry for POST /v1/completions --------------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        t0 = time.perf_counter()
        tenant, arm, version, code = "-", "-", "-", 500
        self.metrics.inflight.inc()
        try:
            token = api_key_of(scope)
            identity = self.keyring.identity_for(token)
            if identity is None:
                tenant, code = "-", 401
                raise unauthorized()
            tenant = identity.tenant
            forced_line = _own_project_only(scope, tenant)
            forced = _forced_version(scope)
            if forced is not None and not identity.may_pin:
                raise pin_forbidden(identity.role)
            req = parse_completion_request(await self._read_body(scope, receive), self.limits)
            self.screen.check_prompt(req.prompt)  # block mode: a prompt holding a credential never reaches the model
            if not self.state.redis_up:
                raise unavailable(
                    "the rollout store (Redis) is unavailable; retry shortly", self.cfg.serving.retry_after_seconds
                )
            uhash = user_hash(token or "")  # the authenticated key only: a client cannot pick its arm
            if forced is None:  # evaluation measures what users get at their own temperature
                req = with_exploration(req, self.cfg.serving.exploration_temperature)
            code, arm, version = await self._complete(
                scope,
                receive,
                send,
                req,
                tenant,
                uhash,
                t0,
                forced,
                reveal=reveals_routing(identity, self.cfg.serving.routing_headers),
                forced_line=forced_line,
            )
        except ApiError as err:
            code = err.status
            await _send_response(send, err.status, err.body(), _retry_headers(err))
        finally:
            self.metrics.inflight.dec()
            self.metrics.requests.labels(tenant, arm, str(version), str(code)).inc()

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes:
        return await read_capped(receive, self.max_body, self._body_too_large, _client_disconnected)

    def _body_too_large(self) -> ApiError:
        return ApiError(
            413,
            f"request body over {self.max_body} bytes (serving.maxPromptChars={self.cfg.serving.max_prompt_chars})",
            code="body_too_large",
        )

    async def _open_upstream(self, body: bytes, client_receive: Receive | None = None) -> EngineResponse:
        """Open the request (its status and headers). With ``client_receive`` (an engine in this process that
        watches the client itself), the whole response: vLLM's handler runs in this task (``post_whole``)."""
        try:
            if client_receive is not None:
                resp = await self.pool.post_whole("/v1/completions", body, client_receive)
            else:
                resp = await self.pool.post("/v1/completions", body)
        except EngineTimeout:
            raise engine_timeout(self.cfg.serving.request_timeout_seconds) from None
        except EngineUnavailable as exc:
            self.state.engine_up = False
            raise unavailable(
                f"the inference engine is unavailable ({exc}); retry shortly", self.cfg.serving.retry_after_seconds
            ) from None
        self.metrics.engine_calls.labels(resp.via).inc()
        return resp

    async def _open_and_read(self, body: bytes) -> EngineResponse:
        """Non-streaming: open the request and read the whole response (vLLM sends its headers only when done)."""
        resp = await self._open_upstream(body)
        try:
            await resp.read()
        except EngineTimeout:
            await resp.aclose()
            raise engine_timeout(self.cfg.serving.request_timeout_seconds) from None
        except EngineUnavailable as exc:
            await resp.aclose()
            raise unavailable(
                f"the inference engine failed mid-request ({exc})", self.cfg.serving.retry_after_seconds
            ) from None
        except BaseException:
            await resp.aclose()  # unread: closing the connection makes vLLM abort the generation
            raise
        return resp

    async def _open_unless_client_leaves(self, body: bytes, receive: Receive | None) -> EngineResponse | None:
        """Streaming (no ``receive``): open the request. Non-streaming: open and read it all, unless the client
        disconnects first; then the connection is closed unread, so vLLM aborts instead of finishing for nobody."""
        if receive is None:
            return await self._open_upstream(body)
        if self.pool.relays_client_disconnect:
            # In vLLM's process: vLLM's handler watches the client's own receive, as it watches its socket, and
            # aborts when the client leaves; no watcher tasks here (each costs a turn of vLLM's busy loop), and vLLM's
            # handler runs in this task (InProcessEngine.post_whole).
            resp = await self._open_upstream(body, receive)
            if resp.client_left:
                await resp.aclose()
                return None
            return resp
        work = asyncio.ensure_future(self._open_and_read(body))
        gone = asyncio.ensure_future(wait_for_disconnect(receive))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            if work.done():
                return work.result()
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError, ApiError):
                await work
            return None
        finally:
            gone.cancel()

    async def _complete(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        req: CompletionRequest,
        tenant: str,
        uhash: str,
        t0: float,
        forced: int | None = None,
        reveal: bool = False,
        forced_line: str = SHARED_LINE,
    ) -> tuple[int, str, int]:
        """``reveal``: the key may see which arm and version served it (eval and admin keys: evaluation, tools);
        a user key never does, so no user can learn whether it is in a canary and steer it (issue 35)."""
        created_at = time.time()
        rollout_id = uuid.uuid4().hex  # ours, known before the first byte: it goes in a response header
        prompt_scan = self.screen.prescan(req.prompt)  # during the generation, off the user's path
        for attempt in (0, 1):
            held = await self._enter_weights(forced)
            try:
                r, model, line, table = self.pick(uhash, forced, held, tenant, forced_line)
                canary = table.candidate if r.arm in (STABLE, CANDIDATE) else None  # the line's canary
            except BaseException:  # e.g. 409 for a version not held: release the gate's count at once
                if held is not None:
                    self.state.weights.leave()
                raise
            self.inflight[model] += 1
            try:
                overhead = time.perf_counter() - t0
                body = upstream_body(req, model, self.cfg.serving.stream_interval)
                resp = await self._open_unless_client_leaves(body, None if req.stream else receive)
                if resp is None:
                    return 499, r.arm, r.version  # a non-streaming client left while vLLM was generating
                if resp.status_code == 404 and attempt == 0 and r.version != 0:
                    # The adapter went away between our model-list refresh and now (unloaded, vLLM restarted).
                    await resp.aclose()
                    await self.state.refresh_models()
                    continue
                if resp.status_code != 200:
                    try:
                        body = await resp.read()
                    except EngineUnavailable:
                        body = b""
                    await resp.aclose()
                    if resp.status_code >= 500:  # engine failing (e.g. EngineDeadError): the client should retry
                        detail = body[:300].decode(errors="replace")
                        raise unavailable(
                            f"the inference engine failed (HTTP {resp.status_code}): {detail}",
                            self.cfg.serving.retry_after_seconds,
                        )
                    await _send_response(send, resp.status_code, body, {})  # vLLM's own 4xx: already OpenAI-shaped
                    return resp.status_code, r.arm, r.version
                headers = {"x-onlinerl-rollout-id": rollout_id}
                if reveal:
                    headers.update(
                        {"x-onlinerl-policy-version": str(r.version), "x-onlinerl-arm": r.arm, "x-onlinerl-line": line}
                    )
                ctx = _Ctx(req, tenant, uhash, r, model, rollout_id, created_at, t0, overhead, canary, line)
                ctx.prompt_scan = prompt_scan
                if req.stream:
                    return await self._relay_stream(resp, ctx, receive, send, headers), r.arm, r.version
                return await self._relay_body(resp, ctx, receive, send, headers), r.arm, r.version
            finally:
                self.inflight[model] -= 1
                if self.inflight[model] <= 0:
                    del self.inflight[model]
                if held is not None:
                    self.state.weights.leave()
        raise AssertionError("unreachable")

    async def _enter_weights(self, forced: int | None = None) -> int | None:
        """Full-weight mode: wait out a weight switch (and, unless pinned to the previewed version, the eval gate's
        preview), then hold the version until the request ends (weights_gate)."""
        if self.cfg.serving.weights_mode != "full":
            return None
        try:
            return await self.state.weights.enter(self.cfg.serving.request_timeout_seconds, forced)
        except WeightsUnknown:
            raise unavailable(
                "the model weights are being switched or are not known yet; retry shortly",
                self.cfg.serving.retry_after_seconds,
            ) from None

    async def _start_record(self, ctx: _Ctx, acc: RolloutAccumulator) -> Coroutine[Any, Any, None]:
        """Send the record's write and return once it is on the wire, before the client's ``[DONE]``.

        Redis applies a command as soon as it reads it; with ``appendfsync always`` only the *reply* waits for the
        fsync (milliseconds). So the record is readable by the feedback service before the client can have the
        completion, while the client no longer waits for the disk. The caller awaits the returned coroutine last."""
        loop = asyncio.get_running_loop()
        if not acc.consistent():
            log.error(
                "vLLM returned %d tokens, %d logprobs, %d offsets: record not stored",
                len(acc.token_ids),
                len(acc.logprobs),
                len(acc.offsets),
            )
            self.metrics.record_errors.inc()
            return _nothing()
        record = acc.to_record(
            tenant=ctx.tenant,
            arm=ctx.route.arm,
            version=ctx.route.version,
            served_model=ctx.model,
            user_hash=ctx.uhash,
            prompt=ctx.req.prompt,
            sampling=sampling_record(ctx.req),
            created_at=ctx.created_at,
            rollout_id=ctx.rollout_id,
            canary=ctx.canary,
            line=ctx.line,
        )
        prompt_findings = None if ctx.prompt_scan is None else await ctx.prompt_scan
        # a credential in the prompt or completion: recorded without the text
        record = self.screen.screen(record, prompt_findings)
        try:
            acknowledged = await self.rollouts.send(record, ctx.req.prompt)
        except Exception as exc:
            acknowledged = loop.create_future()
            acknowledged.set_exception(exc)
        return self._recorded(ctx, acknowledged)

    async def _recorded(self, ctx: _Ctx, acknowledged: asyncio.Future) -> None:
        """A Redis failure costs the record (counted, logged), never the completion."""
        try:
            self.rollouts.acknowledged(ctx.tenant, await acknowledged)  # counts and logs the tenant's evictions
            self.metrics.served(ctx.route.version, ctx.route.arm, ctx.line)
        except Exception as exc:
            log.error("rollout record %s not stored: %s", ctx.rollout_id, exc)
            self.metrics.record_errors.inc()

    async def _relay_body(
        self, resp: EngineResponse, ctx: _Ctx, receive: Receive, send: Send, headers: dict[str, str]
    ) -> int:
        """Non-streaming: the response was read whole while watching the client (``_open_unless_client_leaves``).
        In vLLM's process its dict comes as it is (vllm_completions.py); from a socket it is parsed here."""
        t = time.perf_counter()
        try:
            payload = await resp.json()
        finally:
            await resp.aclose()
        acc = RolloutAccumulator()
        for choice in payload.get("choices", ())[:1]:
            acc.add_choice(choice)
        recording = await self._start_record(ctx, acc)
        try:
            body = orjson.dumps(
                client_view(payload, logprobs=ctx.req.client_logprobs, token_ids=ctx.req.client_token_ids)
            )
            self.metrics.overhead.observe(ctx.overhead + time.perf_counter() - t)
            await _send_response(send, 200, body, headers)
            self.metrics.duration.labels("false").observe(time.perf_counter() - ctx.t0)
        finally:
            await recording
        return 200

    async def _relay_stream(
        self, resp: EngineResponse, ctx: _Ctx, receive: Receive, send: Send, headers: dict[str, str]
    ) -> int:
        disconnected = asyncio.Event()

        async def watch_disconnect() -> None:
            await wait_for_disconnect(receive)
            disconnected.set()

        watcher = asyncio.create_task(watch_disconnect())
        acc = RolloutAccumulator()
        overhead, first, done, errored = ctx.overhead, True, False, False
        recording: Coroutine[Any, Any, None] | None = None
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": _raw_headers(
                        {**headers, "content-type": "text/event-stream", "cache-control": "no-cache"}
                    ),
                }
            )
            buf = b""
            async for data in resp.chunks():
                if disconnected.is_set():
                    return 499
                if done:
                    continue  # after [DONE] only the end of vLLM's body is left: read it so the connection is reused
                t = time.perf_counter()
                *events, buf = (buf + data).split(b"\n\n")  # one pass: coalesced data can hold many events
                out = []
                for event in events:
                    if not event.startswith(b"data: "):
                        continue
                    payload = event[6:]
                    if payload == b"[DONE]":
                        if out:  # the client gets all its text before the record write goes out
                            await send({"type": "http.response.body", "body": b"".join(out), "more_body": True})
                            out = []
                        if not errored:  # vLLM reported an error mid-stream: the text is not a rollout
                            recording = await self._start_record(ctx, acc)
                        out.append(b"data: [DONE]\n\n")
                        done = True
                        break
                    chunk = orjson.loads(payload)
                    if "error" in chunk:
                        errored = True
                        out.append(event + b"\n\n")
                        continue
                    for choice in chunk.get("choices", ())[:1]:
                        acc.add_choice(choice)
                    view = client_view(chunk, logprobs=ctx.req.client_logprobs, token_ids=ctx.req.client_token_ids)
                    out.append(b"data: " + orjson.dumps(view) + b"\n\n")
                if out:
                    overhead += time.perf_counter() - t
                    # [DONE] and the end of the body go out in one write, without waiting for vLLM's own end
                    await send({"type": "http.response.body", "body": b"".join(out), "more_body": not done})
                    if first:
                        self.metrics.ttft.observe(time.perf_counter() - ctx.t0)
                        first = False
            if not done:  # the engine closed the stream early (crash, restart): tell the client, record nothing
                await send(_interrupted("the inference engine ended the stream early; retry"))
            self.metrics.overhead.observe(overhead)
            self.metrics.duration.labels("true").observe(time.perf_counter() - ctx.t0)
            return 200 if done and not errored else 502
        except EngineUnavailable as exc:
            if done:  # the client already has everything, [DONE] included; only vLLM's body end was lost
                return 502 if errored else 200
            log.warning("upstream stream failed: %s", exc)
            with contextlib.suppress(Exception):  # the client may be gone; if not, it must not read this as success
                await send(_interrupted(f"the inference engine stopped sending ({exc}); retry"))
            return 502
        finally:
            watcher.cancel()
            await resp.aclose()
            if recording is not None:
                await recording  # logs and counts its own failure


def _interrupted(message: str) -> dict:
    """The last body message of a stream the engine did not finish: an SSE error event (code
    ``engine_stream_interrupted``) and no [DONE], so no client reads the partial text as a complete suggestion."""
    err = error_body(message, type_="server_error", code="engine_stream_interrupted")
    return {"type": "http.response.body", "body": b"data: " + orjson.dumps(err) + b"\n\n", "more_body": False}


class _Ctx:
    """One request's routing facts, carried from routing to recording."""

    __slots__ = (
        "canary",
        "created_at",
        "line",
        "model",
        "overhead",
        "prompt_scan",
        "req",
        "rollout_id",
        "route",
        "t0",
        "tenant",
        "uhash",
    )

    def __init__(
        self,
        req: CompletionRequest,
        tenant: str,
        uhash: str,
        route: PolicyRoute,
        model: str,
        rollout_id: str,
        created_at: float,
        t0: float,
        overhead: float,
        canary: int | None = None,
        line: str = SHARED_LINE,
    ) -> None:
        self.req, self.tenant, self.uhash, self.route, self.model = req, tenant, uhash, route, model
        self.rollout_id, self.created_at, self.t0, self.overhead = rollout_id, created_at, t0, overhead
        self.canary = canary  # the candidate the table named at routing: the per-user ledger the record counts in
        self.line = line  # the policy line that served it ('' shared, else the key's project: issue 39)
        self.prompt_scan: asyncio.Future | None = None  # the prompt's secret findings (SecretScreen.prescan)


def _client_disconnected() -> ApiError:
    return ApiError(400, "client disconnected while sending the body")


async def _nothing() -> None:
    """An already-finished recording (nothing to store)."""


def _raw_headers(headers: dict[str, str]) -> list[tuple[bytes, bytes]]:
    return [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]


def _retry_headers(err: ApiError) -> dict[str, str]:
    return {"retry-after": str(err.retry_after)} if err.retry_after is not None else {}


async def wait_for_disconnect(receive: Receive) -> None:
    """Returns when the client has gone (the request body was already read, so only ``http.disconnect`` is left)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _send_response(send: Send, status: int, body: bytes, headers: dict[str, str]) -> None:
    hdrs = {**headers, "content-type": "application/json", "content-length": str(len(body))}
    await send({"type": "http.response.start", "status": status, "headers": _raw_headers(hdrs)})
    await send({"type": "http.response.body", "body": body, "more_body": False})


# --- the app ----------------------------------------------------------------------------------------------------
def create_app(cfg: OnlineRLConfig, keyring: KeyRing | None = None, engine: Engine | None = None) -> ASGIApp:
    """The gateway ASGI app; Redis and the engine client are opened in the lifespan. ``engine``: how to reach vLLM
    (default: keep-alive HTTP to ``serving.engineUrl``; in vLLM's own process, :class:`inprocess.InProcessEngine`)."""
    from onlinerl.redisconn import connect_async

    if not cfg.redis.url:
        raise ValueError("redis.url is required for the gateway (e.g. redis://127.0.0.1:6379/0)")
    if keyring is None:
        if cfg.auth.api_keys_file:
            keyring = KeyRing.from_file(cfg.auth.api_keys_file, cfg.auth.allow_anonymous)
        elif cfg.auth.allow_anonymous:
            keyring = KeyRing([], allow_anonymous=True)
        else:
            raise ValueError("auth.apiKeysFile is required (or set auth.allowAnonymous: true for a local demo)")
    redis = connect_async(cfg.redis, health_check_interval=10)  # redis.socketTimeoutSeconds, as every component
    pool = engine or EnginePool.from_url(
        cfg.serving.engine_url,
        connect_timeout=cfg.serving.engine_connect_timeout_seconds,
        read_timeout=cfg.serving.request_timeout_seconds,
    )
    gw = Gateway(cfg, keyring, redis, pool)

    async def models(request: Request) -> Response:
        if gw.keyring.tenant_for(api_key_of(request.scope)) is None:
            return unauthorized().response()
        data = [{"id": cfg.model.served_name, "object": "model", "owned_by": "onlinerl"}]
        return JSONResponse({"object": "list", "data": data})

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    schema = orjson.dumps(openapi_document(gw.limits, cfg.model.served_name))

    async def openapi(request: Request) -> Response:
        """The public API's OpenAPI 3.1 document (no key needed: it holds no secret)."""
        return Response(schema, media_type="application/json")

    async def readyz(request: Request) -> Response:
        ok = gw.state.engine_up and gw.state.redis_up and (cfg.serving.weights_mode != "full" or gw.state.weights.known)
        body = {
            "ready": ok,
            "engine": gw.state.engine_up,
            "redis": gw.state.redis_up,
            "loaded_versions": sorted(gw.state.loaded_versions()),
            "project_lines": {p: sorted(v.loaded) for p, v in sorted(gw.state.lines.items())},
        }
        return JSONResponse(body, status_code=200 if ok else 503)

    async def metrics(request: Request) -> Response:
        m = gw.metrics
        m.engine_up.set(1 if gw.state.engine_up else 0)
        m.observe_tables(gw.state.policy, {p: line.table for p, line in gw.state.lines.items()})
        return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)

    async def engine_metrics(request: Request) -> Response:
        """vLLM's own /metrics, read-only: vLLM listens on loopback only, so Prometheus scrapes it through us."""
        try:
            status, body = await gw.pool.get_bytes("/metrics")
        except EngineUnavailable as exc:
            return Response(f"engine unavailable: {exc}\n", status_code=503, media_type="text/plain")
        return Response(body, status_code=status, media_type=CONTENT_TYPE_LATEST)

    async def inflight(request: Request) -> Response:
        """Per-model in-flight counts for the reloader in the same pod (loopback only: not a public route)."""
        if (request.client.host if request.client else "") not in LOOPBACK:
            return Response(status_code=404)
        return JSONResponse({"models": dict(gw.inflight)})

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        await gw.state.start()
        try:
            yield
        finally:
            await gw.state.stop()
            pool.close()
            await gw.rollouts.close()
            await redis.aclose()

    app = Starlette(
        routes=[
            Route("/v1/completions", gw, methods=["POST"]),
            Route("/v1/models", models),
            Route("/healthz", healthz),
            Route("/openapi.json", openapi),
            Route("/readyz", readyz),
            Route("/metrics", metrics),
            Route("/engine/metrics", engine_metrics),
            Route("/internal/inflight", inflight),
            Route(
                "/internal/weights",
                weights_endpoint(gw.state.weights, LOOPBACK, gw.state.refresh_policy),
                methods=["GET", "POST"],
            ),
        ],
        lifespan=lifespan,
    )
    app.state.gateway = gw
    return with_hot_route(app, "POST", "/v1/completions", gw)  # Starlette keeps the 405 for other methods


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    cfg = load_config()
    serve(create_app(cfg), cfg.serving.host, cfg.serving.port)


if __name__ == "__main__":
    main()
