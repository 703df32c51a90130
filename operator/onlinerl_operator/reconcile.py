"""One reconcile pass for one OnlineRLJob: apply the children, drive the trainer Job, pin, observe, write status.

Two entry points share it: ``reconcile`` (spec created/changed/resumed: applies every child) and ``observe``
(periodic: trainer retries, readiness, Redis figures). Both read the object fresh and hold a per-object lock, so a
timer tick never writes a status computed from a body older than the handler's.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from onlinerl_operator import constants as c
from onlinerl_operator.kube import Kube, KubeError
from onlinerl_operator.observe import apply_pin_and_read, manual_rollback, redis_url
from onlinerl_operator.render import RenderContext, endpoints, render_all, trainer_job
from onlinerl_operator.spec import SpecError, parse_spec
from onlinerl_operator.status import (
    JobStatus,
    Observation,
    derive_conditions,
    derive_phase,
    epoch_from_iso,
    iso_from_epoch,
    now_iso,
    stamp_conditions,
)

log = logging.getLogger("onlinerl.operator")
MONITOR_KINDS = ("ServiceMonitor", "PodMonitor")
# Children removed explicitly on deletion (owner references make the garbage collector do it too).
CHILD_KINDS = (
    "Ingress",
    "Job",
    "Deployment",
    "Service",
    "StatefulSet",
    "ConfigMap",
    "PersistentVolumeClaim",
    *MONITOR_KINDS,
)


@dataclass
class TrainerBook:
    """The trainer-retry bookkeeping kept in status (so it survives an operator restart)."""

    restarts: int = 0
    retry_after: float | None = None
    state: str = "absent"
    message: str = ""
    problems: list[str] = field(default_factory=list)


def _job_condition(job: dict[str, Any], ctype: str) -> bool:
    return any(
        cd.get("type") == ctype and cd.get("status") == "True"
        for cd in (job.get("status") or {}).get("conditions") or []
    )


async def sync_trainer(kube: Kube, ctx: RenderContext, book: TrainerBook, now: float) -> TrainerBook:
    """Drive the trainer Job toward the spec: create, suspend/resume, replace on change, retry on failure."""
    desired = trainer_job(ctx)
    ns, name = ctx.namespace, desired["metadata"]["name"]
    t = ctx.cfg.trainer
    job = await kube.get("Job", ns, name)
    if job is None:
        if book.retry_after is not None and now < book.retry_after:
            book.state = "retrying"
            book.message = (
                f"trainer Job failed; restart {book.restarts}/{t.max_restarts} in {book.retry_after - now:.0f}s"
            )
            return book
        await kube.create(desired)
        book.retry_after = None
        book.state = "suspended" if t.suspend else "pending"
        book.message = "trainer suspended (spec.trainer.suspend)" if t.suspend else "trainer Job created"
        return book
    annotations = (job.get("metadata") or {}).get("annotations") or {}
    if annotations.get(c.ANNO_SPEC_HASH) != desired["metadata"]["annotations"][c.ANNO_SPEC_HASH]:
        # A Job's pod template is immutable: replace it. The new trainer resumes from the latest checkpoint.
        await kube.delete("Job", ns, name)
        book.state, book.message = "pending", "trainer Job replaced for the new spec"
        return book
    if bool((job.get("spec") or {}).get("suspend")) != t.suspend:
        await kube.patch("Job", ns, name, {"spec": {"suspend": t.suspend}})
        job.setdefault("spec", {})["suspend"] = t.suspend
    if _job_condition(job, "Failed"):
        if book.restarts >= t.max_restarts:
            book.state = "failed"
            book.message = (
                f"trainer Job failed {book.restarts + 1} times (trainer.maxRestarts={t.max_restarts}); "
                f"see `kubectl logs job/{name}`; any spec change retries"
            )
            return book
        await kube.delete("Job", ns, name)
        delay = t.restart_backoff_seconds * (2**book.restarts)
        book.restarts += 1
        book.retry_after = now + delay
        book.state = "retrying"
        book.message = f"trainer Job failed; restart {book.restarts}/{t.max_restarts} in {delay:.0f}s"
        return book
    st = job.get("status") or {}
    if _job_condition(job, "Complete"):
        book.state, book.message = "completed", "trainer exited successfully; it stops learning until restarted"
    elif t.suspend:
        book.state, book.message = "suspended", "trainer suspended (spec.trainer.suspend); serving continues"
    elif (st.get("ready") or st.get("active") or 0) > 0:
        book.state, book.message = "running", f"trainer Job {name} running"
    else:
        book.state, book.message = "pending", f"trainer Job {name} waiting for its pod"
    return book


async def deployment_ready(kube: Kube, ns: str, name: str) -> tuple[bool, str]:
    dep = await kube.get("Deployment", ns, name)
    if dep is None:
        return False, f"Deployment {name} not found"
    want = (dep.get("spec") or {}).get("replicas", 1)
    ready = (dep.get("status") or {}).get("readyReplicas") or 0
    if want == 0:
        return False, f"{name} scaled to 0 replicas"
    return ready >= want, f"{name}: {ready}/{want} replicas ready"


def _book_from_status(status: dict[str, Any]) -> TrainerBook:
    retry = status.get("trainerRetryAfter")
    return TrainerBook(
        restarts=int(status.get("trainerRestarts") or 0), retry_after=epoch_from_iso(retry) if retry else None
    )


def compose_status(
    old: dict[str, Any], obs: Observation, observed_generation: int | None, extra: dict[str, Any], now: str
) -> dict[str, Any]:
    """The full status document (validated by the JobStatus model, the same one the CRD schema comes from)."""
    conditions = stamp_conditions(derive_conditions(obs), old.get("conditions") or [], observed_generation, now)
    ready = next(cd for cd in conditions if cd["type"] == "Ready")
    status = {
        **extra,
        "observedGeneration": observed_generation,
        "phase": derive_phase(obs),
        "message": ready["message"],
        "conditions": conditions,
    }
    return JobStatus.model_validate(status).model_dump(by_alias=True, mode="json", exclude_none=False)


def _without_nulls(value: Any) -> Any:
    """What a JSON merge patch leaves stored: null members removed."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


class Reconciler:
    """Holds the client and settings; one instance per operator process."""

    def __init__(self, kube: Kube) -> None:
        self.kube = kube
        self._monitoring: bool | None = None

    async def monitoring_api(self) -> bool:
        try:
            return await self.kube.api_served()
        except Exception:
            return False

    async def _fresh(self, ns: str, name: str) -> dict[str, Any] | None:
        return await self.kube.get("OnlineRLJob", ns, name)

    async def write_status(self, ns: str, name: str, status: dict[str, Any], old: dict[str, Any]) -> None:
        """Merge-patch the status subresource, but only when it changed: every write is a watch event for every
        client of this object (kopf included), so an unchanged status is not rewritten on each observe tick."""
        if _without_nulls(status) != old:
            await self.kube.patch("OnlineRLJob", ns, name, {"status": status}, subresource="status")

    async def reconcile(self, ns: str, name: str, apply: bool) -> dict[str, Any] | None:
        """Apply (if ``apply``) and observe; returns the status written (None if the object is gone)."""
        body = await self._fresh(ns, name)
        if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
            return None
        meta, old = body.get("metadata") or {}, body.get("status") or {}
        generation = meta.get("generation")
        now = time.time()
        if not apply and (old.get("observedGeneration") is None or old.get("observedGeneration") != generation):
            return None  # the spec handler has not applied this generation yet: nothing consistent to observe
        try:
            cfg = parse_spec(name, body.get("spec"))
        except SpecError as exc:
            if not apply:
                return None  # already reported as Invalid by the spec handler
            obs = Observation(generation=generation, invalid=str(exc))
            status = compose_status(
                old, obs, generation, {"trainerRestarts": int(old.get("trainerRestarts") or 0)}, now_iso()
            )
            await self.write_status(ns, name, status, old)
            return status
        ctx = RenderContext(
            name=name, namespace=ns, uid=meta.get("uid", ""), cfg=cfg, monitoring_api=await self.monitoring_api()
        )
        book = _book_from_status(old)
        spec_changed = generation is not None and old.get("observedGeneration") not in (None, generation)
        if apply and spec_changed:
            book = TrainerBook()  # a new spec earns a fresh retry budget
        problems: list[str] = []
        if apply:
            problems += await self.apply_children(ctx)
        book = await sync_trainer(self.kube, ctx, book, now)
        obs = Observation(generation=generation, trainer_state=book.state, trainer_message=book.message)
        obs.serving_ready, obs.serving_message = await deployment_ready(self.kube, ns, ctx.child("serving"))
        obs.feedback_ready, obs.feedback_message = await deployment_ready(self.kube, ns, ctx.child("feedback"))
        extra: dict[str, Any] = {
            "trainerRestarts": book.restarts,
            "endpoints": endpoints(ctx),
            "trainerRetryAfter": iso_from_epoch(book.retry_after) if book.retry_after else None,
        }
        try:
            view = await apply_pin_and_read(
                await redis_url(self.kube, ctx),
                name,
                cfg.rollout.pinned_version,
                paused=cfg.rollout.paused,
                decisions_after=old.get("lastDecisionId"),
            )
            extra["appliedRollbackTo"] = old.get("appliedRollbackTo")
            target = cfg.rollout.rollback_to
            if target is not None and old.get("appliedRollbackTo") != target:
                problem = await manual_rollback(await redis_url(self.kube, ctx), name, target)
                if problem:
                    problems.append(problem)
                else:
                    extra["appliedRollbackTo"] = target
                    log.info("%s/%s: rolled back to v%s (spec.rollout.rollbackTo)", ns, name, target)
                    view = await apply_pin_and_read(
                        await redis_url(self.kube, ctx),
                        name,
                        cfg.rollout.pinned_version,
                        decisions_after=old.get("lastDecisionId"),
                    )
            await self.report_decisions(ctx, view.decisions)
            if view.decisions:
                last_id, last = view.decisions[-1]
                extra["lastDecisionId"] = last_id
                extra["lastDecision"] = f"{last.decision} v{last.version} by {last.actor}: {last.reason}"[:1024]
            else:
                extra["lastDecisionId"], extra["lastDecision"] = old.get("lastDecisionId"), old.get("lastDecision")
            obs.last_decision = extra["lastDecision"] or ""
            obs.last_decision_kind = obs.last_decision.split(" ", 1)[0]
            extra["redisReachable"] = True
            policy = view.policy
            obs.stable_version = policy.stable if policy else None
            obs.candidate_version = policy.candidate if policy else None
            extra.update(
                {
                    "stableVersion": obs.stable_version,
                    "candidateVersion": obs.candidate_version,
                    "pinnedVersion": policy.pinned if policy else None,
                    "canaryShare": policy.canary_share if policy else None,
                    "acceptRate": view.accept_rate,
                    "shown": view.shown,
                    "samplesTrained": view.samples_trained,
                    "trainerStep": view.trainer_step,
                    "lastCheckpointTime": iso_from_epoch(view.last_checkpoint_at) if view.last_checkpoint_at else None,
                }
            )
            if view.pin_changed:
                log.info("%s/%s: policy pinned to %s", ns, name, cfg.rollout.pinned_version)
        except Exception as exc:
            extra["redisReachable"] = False
            for key in ("stableVersion", "candidateVersion", "pinnedVersion", "acceptRate", "samplesTrained"):
                if old.get(key) is not None:
                    extra[key] = old[key]  # keep the last known figures
            problems.append(f"Redis not reachable ({type(exc).__name__}: {exc}); rollout.pinnedVersion not applied yet")
        if ctx.cfg.monitoring.service_monitor == "on" and not ctx.monitoring_api:
            problems.append(
                "monitoring.serviceMonitor=on but monitoring.coreos.com/v1 is not served "
                "(install the Prometheus operator or use auto)"
            )
        obs.problems = problems
        observed = generation if apply else old.get("observedGeneration")
        status = compose_status(old, obs, observed, extra, now_iso())
        await self.write_status(ns, name, status, old)
        return status

    async def apply_children(self, ctx: RenderContext) -> list[str]:
        """Create-or-patch every child except the trainer Job (sync_trainer owns it). Returns problems found."""
        problems = []
        for manifest in render_all(ctx):
            kind = manifest["kind"]
            if kind == "Job" or (kind in MONITOR_KINDS and not ctx.monitoring_api):
                continue
            try:
                verb = await self.kube.apply(manifest)
                log.debug("%s %s/%s", verb, kind, manifest["metadata"]["name"])
            except KubeError as exc:
                if exc.status in (400, 403, 422):
                    problems.append(f"cannot apply {kind} {manifest['metadata']['name']}: {exc}")
                else:
                    raise
        # Children an earlier spec wanted and this one does not (only ones we own: never a user's claim).
        stale: list[tuple[str, str]] = []
        if not ctx.monitors_enabled and ctx.monitoring_api:
            stale += [("ServiceMonitor", ctx.name), ("PodMonitor", ctx.child("reloader"))]
        if ctx.cfg.storage.existing_claim:
            stale.append(("PersistentVolumeClaim", ctx.child("checkpoints")))
        if not ctx.in_cluster_redis:
            stale += [("StatefulSet", ctx.child("redis")), ("Service", ctx.child("redis"))]
        if not ctx.cfg.ingress.enabled:
            stale.append(("Ingress", ctx.name))
        if ctx.cfg.rollout.strategy != "canary":
            stale += [("Deployment", ctx.child("rollout")), ("Service", ctx.child("rollout"))]
        for kind, child in stale:
            await self.delete_owned(kind, ctx.namespace, child, ctx.uid)
        return problems

    async def report_decisions(self, ctx: RenderContext, decisions: list[tuple[str, Any]]) -> None:
        """One Kubernetes Event per rollout decision (gate, promote, rollback, pin...), on the OnlineRLJob."""
        for entry_id, d in decisions:
            warning = d.decision in ("rollback", "gate_fail")
            when = iso_from_epoch(d.at)
            event = {
                "apiVersion": "v1",
                "kind": "Event",
                "metadata": {"name": f"{ctx.name}.rollout.{entry_id.replace('-', '.')}", "namespace": ctx.namespace},
                "involvedObject": {
                    "apiVersion": c.API_VERSION,
                    "kind": c.KIND,
                    "name": ctx.name,
                    "namespace": ctx.namespace,
                    "uid": ctx.uid,
                },
                "reason": "Rollout" + "".join(p.capitalize() for p in d.decision.split("_")),
                "message": f"v{d.version} (stable v{d.stable}) by {d.actor}: {d.reason}"[:1024],
                "type": "Warning" if warning else "Normal",
                "source": {"component": c.MANAGER},
                "firstTimestamp": when,
                "lastTimestamp": when,
                "count": 1,
            }
            try:
                await self.kube.create(event)
            except KubeError as exc:
                log.warning("%s/%s: could not post the rollout event: %s", ctx.namespace, ctx.name, exc)

    async def delete_owned(self, kind: str, ns: str, name: str, owner_uid: str) -> bool:
        """Delete ``kind/name`` only if its owner reference points at ``owner_uid``."""
        obj = await self.kube.get(kind, ns, name)
        owners = ((obj or {}).get("metadata") or {}).get("ownerReferences") or []
        if obj is None or not any(o.get("uid") == owner_uid and o.get("kind") == c.KIND for o in owners):
            return False
        return await self.kube.delete(kind, ns, name)

    async def cleanup(self, ns: str, name: str, uid: str) -> list[str]:
        """Delete every child of a deleted job that it owns. Redis data and the policy table stay."""
        deleted = []
        names = {
            "Ingress": [name],
            "Job": [f"{name}-trainer"],
            "Deployment": [f"{name}-serving", f"{name}-feedback", f"{name}-rollout"],
            "Service": [f"{name}-serving", f"{name}-feedback", f"{name}-trainer", f"{name}-redis", f"{name}-rollout"],
            "StatefulSet": [f"{name}-redis"],
            "ConfigMap": [f"{name}-config"],
            "PersistentVolumeClaim": [f"{name}-checkpoints"],
            "ServiceMonitor": [name],
            "PodMonitor": [f"{name}-reloader"],
        }
        monitoring = await self.monitoring_api()
        for kind in CHILD_KINDS:
            if kind in MONITOR_KINDS and not monitoring:
                continue
            for child in names[kind]:
                if await self.delete_owned(kind, ns, child, uid):
                    deleted.append(f"{kind}/{child}")
        return deleted
