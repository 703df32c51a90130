"""The reloader: turns published checkpoints into loaded, warmed, routable versions in this pod's vLLM.

``python -m onlinerl_serving.reloader`` (metrics and health on ``:8004``). One reconcile loop:

1. read the ``checkpoints`` stream (from the start on boot, then blocking XREAD);
2. *want* the newest ``serving.keepVersions`` good versions plus every version the policy table references;
3. load each wanted version that vLLM lacks (verify manifest -> load under a new name -> warm-up), and under
   ``rollout.strategy: direct`` raise ``policy.stable`` to it; ``serving.maxLoadFailures`` failures mark it failed;
4. unload versions no longer wanted once the gateway reports none of their requests in flight (or after
   ``serving.drainTimeoutSeconds``); the directory is left alone (the trainer deletes only ``retired`` versions);
5. every tick compares vLLM's model list with what it should hold: a restarted vLLM gets its versions back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

import httpx
from onlinerl_serving.checkpoints import Announcement, CheckpointError, verify_checkpoint
from onlinerl_serving.engine_admin import EngineAdmin, EngineError
from onlinerl_serving.metrics import ReloaderMetrics
from onlinerl_serving.routing import served_model_name
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from onlinerl.config import OnlineRLConfig, load_config
from onlinerl.holds import active_holds
from onlinerl.keys import Keys
from onlinerl.schemas import PolicyTable, PolicyVersionState

log = logging.getLogger("onlinerl.reloader")

RELOADER_PORT = 8004

# Raise policy.stable to ARGV[1] only if it is newer: two reloaders (replicas) may race; stable never goes back.
_RAISE_STABLE = """
local cur = tonumber(redis.call('HGET', KEYS[1], 'stable') or '0') or 0
if tonumber(ARGV[1]) > cur then
  redis.call('HSET', KEYS[1], 'stable', ARGV[1], 'updated_at', ARGV[2])
  return 1
end
return 0
"""


@dataclass
class Version:
    """What this reloader knows of one announced version."""

    ann: Announcement
    state: str = "announced"  # announced | loading | loaded | failed | retired
    failures: int = 0
    error: str = ""
    next_attempt: float = 0.0
    unwanted_since: float | None = None


@dataclass
class ReloaderOptions:
    poll_seconds: float = 0.5
    unload_grace_seconds: float = 2.0  # > the gateway's model-list refresh: it has stopped routing there
    retry_backoff_seconds: float = 1.0


class Reloader:
    def __init__(
        self,
        cfg: OnlineRLConfig,
        redis: Any,
        engine: httpx.AsyncClient,
        gateway: httpx.AsyncClient,
        metrics: ReloaderMetrics | None = None,
        options: ReloaderOptions | None = None,
    ) -> None:
        self.cfg = cfg
        self.redis = redis
        self.admin = EngineAdmin(engine)
        self.gateway = gateway
        self.keys = Keys(cfg.job)
        self.metrics = metrics or ReloaderMetrics()
        self.opt = options or ReloaderOptions()
        self.versions: dict[int, Version] = {}
        self.last_id = "0-0"
        self.engine_seen_up = False
        self.weights_version = 0  # full-weight mode: what vLLM's one model holds
        self.last_tick = 0.0
        self.restarts_detected = 0

    @property
    def full(self) -> bool:
        return self.cfg.serving.weights_mode == "full"

    def model_name(self, v: int) -> str:
        return served_model_name(self.cfg.job, self.cfg.model.served_name, v, self.cfg.serving.weights_mode)

    # --- stream ---------------------------------------------------------------------------------------------------
    def _register(self, entry_id: Any, fields: dict[Any, Any]) -> None:
        try:
            ann = Announcement.from_entry(entry_id, fields)
        except CheckpointError as exc:
            log.error("%s", exc)
            return
        if ann.version in self.versions:
            return  # re-announced: a version's directory is immutable, the first announcement stands
        self.versions[ann.version] = Version(ann)
        log.info("checkpoint v%d announced at %s", ann.version, ann.path)

    async def read_stream(self, block_ms: int | None) -> None:
        kwargs = {"count": 100} if block_ms is None else {"count": 100, "block": block_ms}
        resp = await self.redis.xread({self.keys.checkpoints: self.last_id}, **kwargs)
        for _stream, entries in resp or ():
            for entry_id, fields in entries:
                self._register(entry_id, fields)
                self.last_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id

    # --- decisions ------------------------------------------------------------------------------------------------
    async def policy(self) -> PolicyTable:
        raw = await self.redis.hgetall(self.keys.policy)
        return PolicyTable.from_redis(raw) if raw else PolicyTable()

    async def holds(self) -> set[int]:
        return active_holds(await self.redis.hgetall(self.keys.holds), time.time())

    def wanted(self, table: PolicyTable, holds: set[int] = frozenset()) -> list[int]:
        """Versions vLLM should hold, oldest first (so the newest is loaded, and made stable, last): the newest
        ``keepVersions``, the routed ones, and those an evaluation holds."""
        good = sorted(v for v, s in self.versions.items() if s.state != "failed")
        if self.full:
            return good[-1:]
        keep = set(good[-self.cfg.serving.keep_versions :])
        keep |= {
            v
            for v in (table.stable, table.candidate, table.pinned, *holds)
            if v and v in self.versions and self.versions[v].state != "failed"
        }
        return sorted(keep)

    # --- reconcile ------------------------------------------------------------------------------------------------
    async def tick(self) -> None:
        self.last_tick = time.time()
        try:
            names = await self.admin.models()
        except EngineError as exc:
            if self.engine_seen_up:
                log.warning("engine unreachable: %s", exc)
            self.engine_seen_up = False
            return
        if not self.engine_seen_up:
            self.engine_seen_up = True
            if self.full and self.weights_version:
                log.warning("engine came back: reloading full weights v%d", self.weights_version)
                self.versions[self.weights_version].state = "announced"
                self.restarts_detected += 1
        if not self.full:
            self._detect_lost_adapters(names)
        table = await self.policy()
        wanted = self.wanted(table, await self.holds())
        for v in wanted:
            s = self.versions[v]
            s.unwanted_since = None
            if s.state != "loaded" and time.monotonic() >= s.next_attempt:
                await self.load(v)
        if not self.full:
            await self._retire_unwanted(set(wanted), table)
        loaded = [v for v, s in self.versions.items() if s.state == "loaded"]
        self.metrics.loaded.set(len(loaded))
        self.metrics.serving_version.set(max(loaded, default=0))

    def _detect_lost_adapters(self, names: set[str]) -> None:
        lost = [v for v, s in self.versions.items() if s.state == "loaded" and self.model_name(v) not in names]
        if lost:
            self.restarts_detected += 1
            log.warning("vLLM lost adapters %s (restarted?): loading them again", lost)
            for v in lost:
                self.versions[v].state = "announced"

    async def _retire_unwanted(self, wanted: set[int], table: PolicyTable) -> None:
        loaded = [v for v, s in self.versions.items() if s.state == "loaded" and v not in wanted]
        if not loaded:
            return
        now = time.monotonic()
        inflight = await self._gateway_inflight()
        for v in loaded:
            s = self.versions[v]
            s.unwanted_since = s.unwanted_since or now
            waited = now - s.unwanted_since
            busy = inflight.get(self.model_name(v), 0) if inflight is not None else None
            if waited < self.opt.unload_grace_seconds:
                continue
            if busy != 0 and waited < self.cfg.serving.drain_timeout_seconds:
                continue  # requests still streaming from it (or the gateway cannot say): wait for the drain
            try:
                await self.admin.unload_lora(self.model_name(v))
            except EngineError as exc:
                log.warning("unload v%d failed (will retry): %s", v, exc)
                continue
            s.state = "retired"
            await self._save_state(v)
            log.info("v%d unloaded after %.1fs unwanted (in flight: %s)", v, waited, busy)

    async def _gateway_inflight(self) -> dict[str, int] | None:
        try:
            resp = await self.gateway.get("/internal/inflight")
            resp.raise_for_status()
            return {k: int(n) for k, n in resp.json().get("models", {}).items()}
        except (httpx.HTTPError, ValueError):
            return None

    # --- loading --------------------------------------------------------------------------------------------------
    async def load(self, v: int) -> bool:
        s = self.versions[v]
        s.state = "loading"
        await self._save_state(v)
        t0 = time.perf_counter()
        try:
            await asyncio.to_thread(verify_checkpoint, s.ann, self.cfg.job)
            if self.full:
                await self.admin.reload_full_weights(s.ann.path)
            else:
                await self.admin.load_lora(self.model_name(v), s.ann.path)
            await self.admin.warm_up(self.model_name(v))
        except (CheckpointError, EngineError, OSError) as exc:
            await self._load_failed(v, str(exc))
            return False
        self.metrics.duration.observe(time.perf_counter() - t0)
        self.metrics.reloads.labels("success").inc()
        self.metrics.last_reload.set(time.time())
        s.state, s.error, s.failures = "loaded", "", 0
        if self.full:
            for other, o in self.versions.items():
                if other != v and o.state == "loaded":
                    o.state = "retired"
                    await self._save_state(other)
            self.weights_version = v
        await self._save_state(v)
        status = {"last_reload_at": repr(time.time()), "last_version": str(v), "last_error": ""}
        if self.full:
            status["weights_version"] = str(v)
        await self.redis.hset(self.keys.reloader_status, mapping=status)
        if self.cfg.rollout.strategy == "direct":
            raised = await self.redis.eval(_RAISE_STABLE, 1, self.keys.policy, str(v), repr(time.time()))
            if raised:
                log.info("policy.stable -> v%d", v)
        log.info("v%d loaded and warm in %.2fs", v, time.perf_counter() - t0)
        return True

    async def _load_failed(self, v: int, error: str) -> None:
        s = self.versions[v]
        s.failures += 1
        s.error = error
        self.metrics.reloads.labels("failure").inc()
        await self.redis.hset(self.keys.reloader_status, mapping={"last_error": f"v{v}: {error}"[:2000]})
        if s.failures >= self.cfg.serving.max_load_failures:
            s.state = "failed"
            self.metrics.failed.inc()
            log.error("v%d FAILED after %d attempts, not serving it: %s", v, s.failures, error)
            if not self.full:
                with contextlib.suppress(EngineError):
                    await self.admin.unload_lora(self.model_name(v))
        else:
            s.state = "announced"
            s.next_attempt = time.monotonic() + self.opt.retry_backoff_seconds * 2 ** (s.failures - 1)
            log.warning("v%d load attempt %d failed (retrying): %s", v, s.failures, error)
        await self._save_state(v)

    async def _save_state(self, v: int) -> None:
        s = self.versions[v]
        record = PolicyVersionState(
            version=v,
            state=s.state,
            path=s.ann.path,
            served_model=self.model_name(v),
            failures=s.failures,
            error=s.error[:2000],
        )
        await self.redis.hset(self.keys.versions, str(v), record.to_json())

    # --- main loop ------------------------------------------------------------------------------------------------
    async def run(self) -> None:
        """Boot (read every announcement so far), then reconcile forever; errors are logged and retried."""
        while True:
            try:
                await self.read_stream(block_ms=None)
                break
            except Exception as exc:
                log.warning("cannot read checkpoints yet: %s", exc)
                await asyncio.sleep(self.opt.poll_seconds)
        while True:
            try:
                await self.tick()
                await self.read_stream(block_ms=int(self.opt.poll_seconds * 1000))
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.exception("reconcile failed (retrying): %s", exc)
                await asyncio.sleep(self.opt.poll_seconds)


def create_app(cfg: OnlineRLConfig, options: ReloaderOptions | None = None) -> Starlette:
    import redis.asyncio as aioredis

    if not cfg.redis.url:
        raise ValueError("redis.url is required for the reloader")
    redis = aioredis.from_url(cfg.redis.url, socket_connect_timeout=cfg.redis.connect_timeout_seconds)
    engine = httpx.AsyncClient(
        base_url=cfg.serving.engine_url, timeout=httpx.Timeout(60.0, connect=cfg.serving.engine_connect_timeout_seconds)
    )
    gateway = httpx.AsyncClient(base_url=f"http://127.0.0.1:{cfg.serving.port}", timeout=2.0)
    reloader = Reloader(cfg, redis, engine, gateway, options=options)

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(reloader.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def healthz(request: Request) -> Response:
        age = time.time() - reloader.last_tick if reloader.last_tick else None
        ok = task is not None and not task.done()
        body = {
            "ok": ok,
            "last_tick_age_s": age,
            "restarts_detected": reloader.restarts_detected,
            "versions": {v: s.state for v, s in sorted(reloader.versions.items())},
        }
        return JSONResponse(body, status_code=200 if ok else 503)

    task: asyncio.Task | None = None

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        nonlocal task
        task = asyncio.create_task(reloader.run())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await engine.aclose()
            await gateway.aclose()
            await redis.aclose()

    app = Starlette(routes=[Route("/metrics", metrics), Route("/healthz", healthz)], lifespan=lifespan)
    app.state.reloader = reloader
    return app


def main() -> None:
    import os

    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    cfg = load_config()
    port = int(os.environ.get("ONLINERL_RELOADER_PORT", RELOADER_PORT))
    uvicorn.run(create_app(cfg), host=cfg.serving.host, port=port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
