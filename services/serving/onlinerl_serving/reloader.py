"""The reloader: turns published checkpoints into loaded, warmed, routable versions in this pod's vLLM.

``python -m onlinerl_serving.reloader`` (metrics and health on ``onlinerl.ports.RELOADER``). One reconcile loop:

1. read the ``checkpoints`` stream (from the start on boot, then blocking XREAD);
2. *want* the newest ``serving.keepVersions`` good versions plus every version the policy table references;
3. load each wanted version that vLLM lacks (verify manifest -> load under a new name -> warm-up), and under
   ``rollout.strategy: direct`` raise ``policy.stable`` to it; ``serving.maxLoadFailures`` failures mark it failed;
4. unload versions no longer wanted once the gateway reports none of their requests in flight (or after
   ``serving.drainTimeoutSeconds``); the directory is left alone (the trainer deletes only ``retired`` versions);
5. every tick compares vLLM's model list with what it should hold: a restarted vLLM gets its versions back.

Per-project adapters (issue 39, ``projects.adapters`` listed or all, LoRA only): each project's own policy line has its
own ``checkpoints`` stream, policy table, holds and version states (``Keys.for_project``); the reloader follows every
line the same way (:mod:`onlinerl_serving.project_lines`), one :class:`Reloader` per line sharing this one's engine,
and loads a project's versions under ``{job}@{project}-v{N}`` from its own folder only. vLLM keeps every registered
adapter's name and the ``serving.lora.maxCpuLoras`` most recently used in memory: one evicted is read from its folder
again by its next request (slower, never failed).

The direct raise is one Lua script that refuses while the table holds a manual decision (``hold``, set by
``onlinerl policy rollback`` / ``pin``, cleared by ``resume``), while ``paused``, for a version the rollout rolled
back, and for one whose announcement is off the last manual rollback's lineage (its ``rollback_at``: trained on the
weights the rollback dropped): a human's rollback survives any reload, reloader restart or vLLM restart.

Full-weight mode (``serving.weightsMode: full``) holds one version: the one the policy table gives this replica
(pinned, else a candidate with ``canary_share`` 1 -- blue/green's switch --, else stable; under ``direct`` stable is
raised first). The newest version above stable is verified and recorded ``ready`` (switchable) for the gate. Changing
it: tell the gateway ``switching`` (it stops sending and drains), pause vLLM, reload the weights (the base model's for
v0), record ``weights_version`` while still paused, resume, warm up, tell the gateway ``serving`` vN.
Requests are thus labelled with the version that serves them.

The eval gate's preview (policy ``preview`` vN before ``preview_until``, set by the rollout controller): the same
switch, but the gateway is told ``previewing`` vN (only eval requests pinned to vN go, users wait) and vN is recorded
``previewing``. When the preview ends the table says what next: vN is the candidate with all traffic (passed: the
same weights, now ``serving``, no second swap), or it is not (failed, timed out: switch back). Past ``preview_until``
the reloader ends the preview by itself, so a controller that died mid-preview cannot hold users.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from onlinerl import ports
from onlinerl.config import OnlineRLConfig, load_config
from onlinerl.dataplane import audit, checkpoints, holds, policy, versions
from onlinerl.keys import SHARED_LINE, Keys
from onlinerl.lines import adapter_name, checkpoint_root
from onlinerl.schemas import AuditEntry, PolicyTable, PolicyVersionState
from onlinerl.tied_head import BASE_DIR, base_weights_path
from onlinerl_serving.checkpoints import Announcement, CheckpointError, confine, validate
from onlinerl_serving.engine_admin import EngineAdmin, EngineError
from onlinerl_serving.metrics import ReloaderMetrics
from onlinerl_serving.project_lines import ProjectLines
from onlinerl_serving.routing import served_model_name

log = logging.getLogger("onlinerl.reloader")

RELOADER_PORT = ports.RELOADER
PREVIEW_CLOCK_SLACK_SECONDS = 30.0  # how far a preview's deadline may exceed the bound (clock skew between pods)


@dataclass
class Version:
    """What this reloader knows of one announced version."""

    ann: Announcement
    state: str = "announced"  # announced | loading | loaded | failed | retired
    failures: int = 0
    error: str = ""
    next_attempt: float = 0.0
    unwanted_since: float | None = None
    verified: bool = False  # manifest checked in this life of the reloader (directories are immutable)


@dataclass
class ReloaderOptions:
    poll_seconds: float = 0.5
    unload_grace_seconds: float = 2.0  # > the gateway's model-list refresh: it has stopped routing there
    retry_backoff_seconds: float = 1.0
    heartbeat_seconds: float = versions.HEARTBEAT_EVERY_SECONDS  # while vLLM answers, this replica beats this often
    heartbeat_ttl_seconds: float = versions.HEARTBEAT_TTL_SECONDS  # ...and drops out of the live set if it stops


class Reloader:
    def __init__(
        self,
        cfg: OnlineRLConfig,
        redis: Any,
        engine: httpx.AsyncClient,
        gateway: httpx.AsyncClient,
        metrics: ReloaderMetrics | None = None,
        options: ReloaderOptions | None = None,
        replica: str | None = None,
        line: str = SHARED_LINE,
    ) -> None:
        self.cfg = cfg
        # This replica's id (its own versions hash and heartbeat): ``replica``, else $ONLINERL_REPLICA, else host-pid.
        self.replica = versions.check_replica(replica or versions.default_replica_id())
        self.redis = redis
        self.engine = engine
        self.admin = EngineAdmin(engine)
        self.gateway = gateway
        self.line = line  # the policy line this reloader follows ('' shared, else a project's own: issue 39)
        self.keys = Keys(cfg.job).for_line(line)
        self.metrics = metrics or ReloaderMetrics()
        self.opt = options or ReloaderOptions()
        self.versions: dict[int, Version] = {}
        self.last_id = "0-0"
        self.refusals: list[bytes] = []  # audit entries of refused announcements, not yet written
        self.engine_seen_up = False
        self.holding: int | None = None  # full-weight mode: what vLLM's one model holds (None: not known)
        self.previewing = False  # full-weight mode: ``holding`` is a preview for the eval gate (users wait)
        self.refused_preview: tuple[int, float] | None = None  # the last out-of-bounds preview refused (logged once)
        self.base_next_attempt = 0.0  # full-weight mode: retry backoff for reloading the base model (v0)
        self.base_failures = 0
        self.last_raise: dict[str, Any] | None = None  # strategy direct: the last raise tried and its outcome
        self.last_tick = 0.0
        self.restarts_detected = 0
        self.last_beat: float | None = None  # server deadline of the last heartbeat (None: not beating yet)
        self.raise_tried: set[int] = set()  # strategy direct, LoRA: versions whose raise was tried (once each)
        # The shared line's reloader also follows every project line (LoRA and projects.adapters listed/all).
        self.projects: ProjectLines | None = None
        if not line and cfg.projects.adapters != "off":
            if self.full:
                log.error(
                    "projects.adapters=%s needs serving.weightsMode lora: project lines not served",
                    cfg.projects.adapters,
                )
            else:
                self.projects = ProjectLines(cfg, redis, self.for_line)

    def for_line(self, line: str) -> Reloader:
        """A reloader of project ``line`` sharing this one's engine, gateway, Redis, metrics and replica id."""
        return Reloader(
            self.cfg, self.redis, self.engine, self.gateway, self.metrics, self.opt, self.replica, line=line
        )

    @property
    def full(self) -> bool:
        return self.cfg.serving.weights_mode == "full"

    def model_name(self, v: int) -> str:
        if self.line:  # a project's version (its v0 is the base model, which no project line loads)
            return adapter_name(self.cfg.job, v, self.line)
        return served_model_name(self.cfg.job, self.cfg.model.served_name, v, self.cfg.serving.weights_mode)

    def _where(self) -> str:
        return f"project {self.line}'s " if self.line else ""

    # --- stream ---------------------------------------------------------------------------------------------------
    def _refuse(self, what: str, exc: CheckpointError) -> None:
        """An announcement (or its folder) we will not load: an ERROR line, the metric and an audit entry (written by
        ``_write_refusals``); the loop goes on."""
        self.metrics.refused.labels(exc.reason).inc()
        what = self._where() + what
        log.error("refused %s (%s): %s", what, exc.reason, exc)
        self.refusals.append(
            AuditEntry(event_id=what, tenant=self.line, outcome="refused_by_reloader", reason=exc.reason).to_json()
        )

    async def _write_refusals(self) -> None:
        """Audit what was refused; kept for the next try if Redis fails (the refusal itself already stands).

        The batch is taken before the await: the stream loop and a load can both get here at once, and each entry
        must be written by exactly one of them (a list read across the await was written twice, or a refusal
        appended during the write was cleared unwritten)."""
        batch, self.refusals = self.refusals, []
        if not batch:
            return
        try:
            await audit.record_async(self.redis, self.keys, batch)
        except BaseException:
            self.refusals[:0] = batch  # first in line for the next try, ahead of anything refused meanwhile
            raise

    def _register(self, entry_id: Any, fields: dict[Any, Any]) -> None:
        """Take an announcement only if its path is the announced version's folder (checkpoints.confine): a poisoned
        entry never becomes a version, so a good announcement of the same version after it still counts."""
        try:
            ann = Announcement.from_entry(entry_id, fields)
            confine(ann, self.cfg.storage.checkpoint_dir, self.cfg.job, self.line)
        except CheckpointError as exc:
            self._refuse(f"checkpoints entry {entry_id!r}", exc)
            return
        known = self.versions.get(ann.version)
        if known is not None:
            # Re-announced: a version's directory is immutable, the first announcement stands. A different path or
            # manifest for the same version is someone else's claim: refused and said so.
            if (known.ann.path, known.ann.manifest_sha256) != (ann.path, ann.manifest_sha256):
                message = f"v{ann.version} announced again as {ann.path} (first: {known.ann.path}); keeping the first"
                self._refuse(f"checkpoints entry {ann.entry_id}", CheckpointError(message, "conflicting_announcement"))
            return
        self.versions[ann.version] = Version(ann)
        log.info("%scheckpoint v%d announced at %s", self._where(), ann.version, ann.path)

    def validate(self, v: int) -> None:
        """Place and contents of v's folder (blocking file I/O: run it in a thread); CheckpointError if refused."""
        validate(self.versions[v].ann, self.cfg.storage.checkpoint_dir, self.cfg.job, self.line)

    async def read_stream(self, block_ms: int | None) -> None:
        """New announcements on this line, and on every project line this reloader follows, in one XREAD."""
        lines = {self.keys.checkpoints: self, **(self.projects.by_stream() if self.projects else {})}
        positions = {stream: r.last_id for stream, r in lines.items()}
        for stream, entry_id, fields in await checkpoints.read_streams_after(self.redis, positions, 100, block_ms):
            r = lines[stream]
            r._register(entry_id, fields)
            r.last_id = entry_id
        for r in lines.values():
            await r._write_refusals()

    # --- decisions ------------------------------------------------------------------------------------------------
    async def policy(self) -> PolicyTable:
        return await policy.read_async(self.redis, self.keys)

    async def holds(self) -> set[int]:
        return await holds.read_async(self.redis, self.keys)

    def wanted(self, table: PolicyTable, holds: set[int] = frozenset()) -> list[int]:
        """Versions vLLM should hold, in load order: the ones users are routed to or an evaluation holds first
        (stable, candidate, pinned, holds: after a restart users get them, not a judged older version, as soon as
        possible), then the rest of the newest ``keepVersions``; each group oldest first (so under ``direct`` the
        newest is loaded, and made stable, last)."""
        good = sorted(v for v, s in self.versions.items() if s.state != "failed")
        routed = {
            v
            for v in (table.stable, table.candidate, table.pinned, *holds)
            if v and v in self.versions and self.versions[v].state != "failed"
        }
        recent = set(good[-self.cfg.serving.keep_versions :]) - routed
        return sorted(routed) + sorted(recent)

    # --- reconcile ------------------------------------------------------------------------------------------------
    async def tick(self) -> None:
        self.last_tick = time.time()
        try:
            names = await self.admin.models()
        except EngineError as exc:
            if self.engine_seen_up:
                log.warning("engine unreachable: %s", exc)
            self.engine_seen_up = False
            if self.full and self.holding is not None:  # a restarted vLLM holds the base weights, not ours
                self.holding, self.previewing = None, False
                self.restarts_detected += 1
                await self._tell_gateway({"state": "unknown"})
            return
        self.engine_seen_up = True
        if self.last_beat is None:
            await self.beat()  # join the live set now; the heartbeat task keeps it
        if self.full:
            await self._tick_full()
            return
        await self.reconcile(names)
        loaded = [v for v, s in self.versions.items() if s.state == "loaded"]
        self.metrics.loaded.set(len(loaded))
        self.metrics.serving_version.set(max(loaded, default=0))
        if self.projects is not None:
            await self.projects.tick(names)

    async def reconcile(self, names: set[str], table: PolicyTable | None = None, held: set[int] | None = None) -> None:
        """One LoRA line's step: what vLLM lost is loaded again, what is wanted loaded, what is not retired.
        ``table``, ``held``: the line's policy table and holds when already read (project lines: one pipeline)."""
        self._detect_lost_adapters(names)
        table = await self.policy() if table is None else table
        wanted = self.wanted(table, await self.holds() if held is None else held)
        for v in wanted:
            s = self.versions[v]
            s.unwanted_since = None
            if s.state != "loaded" and time.monotonic() >= s.next_attempt:
                await self.load(v)
        await self._retire_unwanted(set(wanted), table)
        if self.cfg.rollout.strategy == "direct" and (not self.line or self._untried_loaded()):
            await self._raise_everywhere(once=True)  # also completes a switch once a lagging replica died

    def _untried_loaded(self) -> bool:
        """A version loaded here whose raise was not tried yet: only then can a project line's direct raise do
        anything (its target is loaded on every live replica, this one included), so a line with nothing new costs no
        read of the replicas' states each tick."""
        return any(s.state == "loaded" and v not in self.raise_tried for v, s in self.versions.items())

    def _detect_lost_adapters(self, names: set[str]) -> None:
        lost = [v for v, s in self.versions.items() if s.state == "loaded" and self.model_name(v) not in names]
        if lost:
            self.restarts_detected += 1
            log.warning("vLLM lost %sadapters %s (restarted?): loading them again", self._where(), lost)
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
            log.info("%sv%d unloaded after %.1fs unwanted (in flight: %s)", self._where(), v, waited, busy)

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
            await asyncio.to_thread(self.validate, v)
            await self.admin.load_lora(self.model_name(v), s.ann.path)
            await self.admin.warm_up(self.model_name(v))
        except CheckpointError as exc:
            self._refuse(f"v{v} at {s.ann.path}", exc)
            await self._write_refusals()
            await self._load_failed(v, str(exc))
            return False
        except (EngineError, OSError) as exc:
            await self._load_failed(v, str(exc))
            return False
        self.metrics.duration.observe(time.perf_counter() - t0)
        self.metrics.reloads.labels("success").inc()
        self.metrics.last_reload.set(time.time())
        s.state, s.error, s.failures = "loaded", "", 0
        await self._save_state(v)
        status = {"last_reload_at": repr(time.time()), "last_version": str(v), "last_error": ""}
        await self._set_status(status)
        if self.cfg.rollout.strategy == "direct":
            await self._raise_everywhere(once=True)
        log.info("%sv%d loaded and warm in %.2fs", self._where(), v, time.perf_counter() - t0)
        return True

    async def _set_status(self, fields: dict[str, str]) -> None:
        """The job-wide reloader status hash says what the shared line did (``onlinerl status``); a project line
        writes only its errors there, named with the project, so its version numbers never read as the shared
        line's."""
        if self.line:
            fields = {k: f"project {self.line}: {v}" for k, v in fields.items() if k == "last_error" and v}
            if not fields:
                return
        await versions.set_reloader_status(self.redis, self.keys, fields)

    async def _raise_everywhere(self, version: int | None = None, once: bool = False) -> bool:
        """strategy direct: raise stable to ``version`` (default: the newest) once every LIVE replica has it loaded
        (full weights: switchable, ``ready``): the switch completes for the live set only, never before a ready
        replica has it. Each replica checks every tick, so the last to load it, or a survivor of one that died, raises
        it. ``once`` (LoRA): each version is tried once per life of this reloader, as when a load raised it: a stable
        lowered by hand later is not raised again by a version loaded long before."""
        table = await versions.read_async(self.redis, self.keys)
        switchable = {v for v, s in table.states.items() if s.state == "ready"} if self.full else set()
        everywhere = table.loaded() | switchable
        target = max(everywhere, default=0) if version is None else version
        if target <= 0 or target not in everywhere or (once and target in self.raise_tried):
            return False
        raised = await self._raise_stable(target)
        self.raise_tried.add(target)
        return raised

    async def _raise_stable(self, v: int) -> bool:
        """strategy direct: make ``v`` stable unless the table forbids it (see ``policy.RAISE_STABLE``), also when
        its announcement shows it was trained on weights a manual rollback dropped."""
        known = self.versions.get(v)
        code = await policy.raise_stable(self.redis, self.keys, v, known.ann.rollback_at if known else None)
        result = "raised" if code == policy.RAISED else policy.NOT_RAISED[code]
        if code == 1:
            log.info("%spolicy.stable -> v%d", self._where(), v)
        elif code < 0 and self.last_raise != {"version": v, "result": result}:
            log.info("%sv%d not made stable: %s", self._where(), v, result)
        self.last_raise = {"version": v, "result": result}
        return code == 1

    # --- full-weight mode -----------------------------------------------------------------------------------------
    def full_target(self, table: PolicyTable) -> int:
        """The version this replica must hold: pinned, else the candidate when it has the whole traffic (blue/green's
        switch: ``canary_share`` 1, the gateway's ``choose`` sends everyone there too), else stable. One it cannot
        load (failed, never announced) falls back to the newest good version below stable, else the base model:
        serving never stops, and a failed candidate never drags in an older unjudged version."""
        cand = table.candidate
        everyone = table.pinned is None and cand is not None and table.canary_share >= 1.0
        if everyone and cand in self.versions and self.versions[cand].state != "failed":
            return cand
        want = table.pinned if table.pinned is not None else table.stable
        return max((v for v, s in self.versions.items() if s.state != "failed" and v <= want), default=0)

    def preview_target(self, table: PolicyTable, now: float) -> int | None:
        """The version to hold for the eval gate's preview: the table's ``preview`` before ``preview_until`` (wall
        clock ``now``). None when there is none, it expired, a pin holds the table, or this replica cannot load it
        now (failed, never announced here, backing off after a failed load): users are never held for a swap that is
        not happening (the controller's wait then times out and the gate retries later). A deadline further away than
        ``rollout.gate.previewTimeoutSeconds`` (+ ``PREVIEW_CLOCK_SLACK_SECONDS`` for clock skew between pods) is
        refused: no writer of the table can hold users longer than the configured bound."""
        v = table.previewing(now)
        if v is None or table.pinned is not None:
            return None
        if table.preview_until - now > self.cfg.rollout.gate.preview_timeout_seconds + PREVIEW_CLOCK_SLACK_SECONDS:
            if self.refused_preview != (v, table.preview_until):
                log.error(
                    "policy.preview v%d until %.0fs from now is over rollout.gate.previewTimeoutSeconds (%.0fs): "
                    "refused, users stay on stable",
                    v,
                    table.preview_until - now,
                    self.cfg.rollout.gate.preview_timeout_seconds,
                )
                self.refused_preview = (v, table.preview_until)
            return None
        s = self.versions.get(v)
        if s is None or s.state == "failed" or time.monotonic() < s.next_attempt:
            return None
        return v

    async def _tick_full(self) -> None:
        table = await self.policy()
        newest = max((v for v, s in self.versions.items() if s.state != "failed"), default=0)
        if newest > table.stable and await self._verify(newest):
            if self.versions[newest].state == "announced":  # switchable: the blue/green gate may take it now
                self.versions[newest].state = "ready"
                await self._save_state(newest)
            if self.cfg.rollout.strategy == "direct" and await self._raise_everywhere(newest):
                table = await self.policy()
        preview = self.preview_target(table, time.time())
        target = preview if preview is not None else self.full_target(table)
        if target == self.holding:
            if self.previewing and preview is None:  # the preview passed: the same weights now serve everyone
                await self._settle(target)
            # a restarted gateway learns it here
            await self._tell_gateway({"state": "previewing" if self.previewing else "serving", "version": target})
            return
        retry_at = self.versions[target].next_attempt if target else self.base_next_attempt
        if time.monotonic() >= retry_at:
            await self._switch_full(target, table, preview=preview is not None)

    async def _verify(self, v: int) -> bool:
        """Check v's manifest once per life (a failure counts as a load failure, with the same backoff)."""
        s = self.versions[v]
        if s.verified:
            return True
        if time.monotonic() < s.next_attempt:
            return False
        try:
            await asyncio.to_thread(self.validate, v)
        except CheckpointError as exc:
            self._refuse(f"v{v} at {s.ann.path}", exc)
            await self._write_refusals()
            await self._load_failed(v, str(exc))
            return False
        except OSError as exc:
            await self._load_failed(v, str(exc))
            return False
        s.verified = True
        return True

    def base_weights(self) -> str:
        """What vLLM reloads for v0 (blocking file I/O): the trainer's copy of the base with its tied LM head when it
        checks out, else ``model.path`` (onlinerl/tied_head.py: without a head, vLLM keeps the last version's)."""
        root = checkpoint_root(self.cfg.storage.checkpoint_dir, self.cfg.job)
        path, problems = base_weights_path(root, self.cfg.model.path)
        if problems:
            log.error(
                "refusing %s for v0 (%s): reloading %s, its LM head may stay the last version's",
                root / BASE_DIR,
                "; ".join(problems),
                path,
            )
        return path

    async def _switch_full(self, v: int, table: PolicyTable, preview: bool = False) -> bool:
        """Make vLLM hold v (its directory, or the base model for v0) with the gateway drained around the swap;
        ``preview``: for the eval gate's requests only (the gateway keeps user requests waiting)."""
        s = self.versions.get(v)
        if s is not None and not await self._verify(v):
            return False
        path = s.ann.path if s is not None else await asyncio.to_thread(self.base_weights)
        if s is not None:
            s.state = "loading"
            await self._save_state(v)
        t0 = time.perf_counter()
        drain = self.cfg.serving.drain_timeout_seconds
        told = await self._tell_gateway({"state": "switching", "drainTimeoutSeconds": drain}, timeout=drain + 10)
        if told is not None and not told.get("drained"):
            log.warning("gateway still has %s requests in flight after %.0fs: vLLM's pause drains them", told, drain)
        previous, self.holding, self.previewing = self.holding, None, False

        async def record_held() -> None:  # vLLM is still paused: nothing has been served by v yet
            await versions.set_reloader_status(self.redis, self.keys, {"weights_version": str(v)})

        try:
            await self.admin.reload_full_weights(path, before_resume=record_held)
            await self.admin.warm_up(self.model_name(v))
        except EngineError as exc:
            await self._tell_gateway({"state": "unknown"})
            await versions.set_reloader_status(self.redis, self.keys, {"weights_version": ""})
            if s is not None:
                await self._load_failed(v, str(exc))
            else:
                self.base_failures += 1
                self.base_next_attempt = time.monotonic() + self.opt.retry_backoff_seconds * 2 ** min(
                    self.base_failures - 1, 6
                )
                self.metrics.reloads.labels("failure").inc()
                log.error("reloading the base model's weights failed (retrying): %s", exc)
            return False
        self.holding, self.base_failures = v, 0
        self.metrics.duration.observe(time.perf_counter() - t0)
        self.metrics.reloads.labels("success").inc()
        self.metrics.last_reload.set(time.time())
        if preview and s is not None:
            self.previewing = True
            s.state, s.error, s.failures = "previewing", "", 0
            await self._save_state(v)
            await self._tell_gateway({"state": "previewing", "version": v})
        else:
            await self._settle(v)
        log.info(
            "full weights v%s -> v%d%s (pinned=%s stable=%d) in %.2fs",
            previous,
            v,
            " (preview for the eval gate: user requests wait)" if self.previewing else "",
            table.pinned,
            table.stable,
            time.perf_counter() - t0,
        )
        return True

    async def _settle(self, v: int) -> None:
        """vLLM's weights v serve users: record it, then let users in. A version left ``previewing`` (its preview
        ended without passing) goes back to ``ready``: the gate may take it again after a timeout."""
        self.previewing = False
        self.metrics.loaded.set(1)
        self.metrics.serving_version.set(v)
        for other, o in self.versions.items():
            if other != v and o.state in ("loaded", "previewing"):
                o.state = "retired" if o.state == "loaded" else "ready"
                await self._save_state(other)
        s = self.versions.get(v)
        if s is not None:
            s.state, s.error, s.failures = "loaded", "", 0
            await self._save_state(v)
        status = {"last_reload_at": repr(time.time()), "last_version": str(v), "last_error": ""}
        await versions.set_reloader_status(self.redis, self.keys, status)
        await self._tell_gateway({"state": "serving", "version": v})

    async def _tell_gateway(self, body: dict[str, Any], timeout: float = 2.0) -> dict[str, Any] | None:
        """Drive the gateway's weights gate (full-weight mode); None if the gateway does not answer (it then
        knows nothing and waits: a restarted gateway is told at the next tick)."""
        try:
            resp = await self.gateway.post("/internal/weights", json=body, timeout=timeout)
            resp.raise_for_status()
            return resp.json()
        except (httpx.HTTPError, ValueError) as exc:
            log.debug("gateway not told %s: %s", body, exc)
            return None

    async def _load_failed(self, v: int, error: str) -> None:
        s = self.versions[v]
        s.failures += 1
        s.error = error
        self.metrics.reloads.labels("failure").inc()
        await self._set_status({"last_error": f"v{v}: {error}"[:2000]})
        if s.failures >= self.cfg.serving.max_load_failures:
            s.state = "failed"
            self.metrics.failed.inc()
            log.error("%sv%d FAILED after %d attempts, not serving it: %s", self._where(), v, s.failures, error)
            if not self.full:
                with contextlib.suppress(EngineError):
                    await self.admin.unload_lora(self.model_name(v))
        else:
            s.state = "announced"
            s.next_attempt = time.monotonic() + self.opt.retry_backoff_seconds * 2 ** (s.failures - 1)
            log.warning("%sv%d load attempt %d failed (retrying): %s", self._where(), v, s.failures, error)
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
            rollback_at=s.ann.rollback_at,
        )
        await versions.save_state(self.redis, self.keys, self.replica, record)

    # --- heartbeat ------------------------------------------------------------------------------------------------
    async def beat(self) -> None:
        """This replica is live for ``heartbeat_ttl_seconds`` more (only while its vLLM answers: a replica whose
        engine is down is not ready, drops out of the live set, and stops holding switches back)."""
        if self.engine_seen_up:
            ttl = self.opt.heartbeat_ttl_seconds
            self.last_beat = await versions.beat_async(self.redis, self.keys, self.replica, ttl)
            if self.projects is not None:
                await self.projects.keep(self.replica)

    async def heartbeat(self) -> None:
        """Beat every ``heartbeat_seconds``, apart from the reconcile loop: a long load or a full-weight swap must not
        make a live replica look dead (its versions would stop pinning)."""
        while True:
            try:
                await self.beat()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("heartbeat failed (retrying): %s", exc)
            await asyncio.sleep(self.opt.heartbeat_seconds)

    async def leave(self) -> None:
        """Leave the live set at shutdown: this replica's versions stop pinning and stop holding switches at once."""
        try:
            await versions.leave_async(self.redis, self.keys, self.replica)
            if self.projects is not None:
                await self.projects.leave(self.replica)
        except Exception as exc:
            log.warning("could not leave the live set (it lapses in %.0fs): %s", self.opt.heartbeat_ttl_seconds, exc)

    # --- main loop ------------------------------------------------------------------------------------------------
    async def run(self) -> None:
        """Boot (read every announcement so far), then reconcile forever with the heartbeat beside it; errors are
        logged and retried. Cancelled: leave the live set."""
        beating = asyncio.create_task(self.heartbeat())
        try:
            await self._run()
        finally:
            beating.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beating
            await self.leave()

    async def _run(self) -> None:
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
    from onlinerl.redisconn import connect_async

    if not cfg.redis.url:
        raise ValueError("redis.url is required for the reloader")
    # The blocking XREAD waits poll_seconds: the reply deadline stays above it (onlinerl.redisconn).
    redis = connect_async(cfg.redis, longest_block_seconds=(options or ReloaderOptions()).poll_seconds)
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
            "holding": reloader.holding,
            "replica": reloader.replica,
            "last_raise": reloader.last_raise,
            "versions": {v: s.state for v, s in sorted(reloader.versions.items())},
            "lines": reloader.projects.states() if reloader.projects is not None else {},
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

    from onlinerl.asgi import serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    cfg = load_config()
    port = int(os.environ.get("ONLINERL_RELOADER_PORT", RELOADER_PORT))
    serve(create_app(cfg), cfg.serving.host, port)


if __name__ == "__main__":
    main()
