"""One reconcile pass for one OnlineRLJob: an ordered list of steps, then a pure status composition.

Each step owns one concern and fills its part of the :class:`Observation`:

1. ``children``   -- server-side apply of every child but the trainer Job; delete the ones the spec no longer wants
2. ``trainer``    -- drive the trainer Job: create, suspend/resume, replace on a new spec, retry on failure
3. ``components`` -- readiness of the serving and feedback Deployments
4. ``data plane`` -- the job's Redis: policy table, figures, new rollout decisions (each one a Kubernetes Event), and
   the same for every project policy line (issue 39: status.projects, Events naming the project)

The first step the Kubernetes API refuses ends the pass: its typed reason (:class:`StepFailure`, ``Reason.API_*``)
goes into the Degraded condition, the status is written, and the handler turns the failure into kopf's typed retry.
The status is composed by pure functions (status.py) and written only when it changed.

Two entry points share it: ``reconcile(apply=True)`` (spec created/changed/resumed) and ``reconcile(apply=False)``
(the periodic observe: trainer retries, readiness, Redis figures). Both read the object fresh under a per-object lock.
One-shot spec fields (``rollout.pinnedVersion``, ``rollout.paused``, ``rollout.rollbackTo``) are applied by field
handlers through :meth:`Reconciler.apply_policy_field` and :meth:`Reconciler.apply_rollback`, once per change.
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import RedisError

from onlinerl.keys import SHARED_LINE
from onlinerl_operator import constants as c
from onlinerl_operator.kube import Kube, KubeError
from onlinerl_operator.observe import manual_rollback, read_view, redis_url, write_policy_field
from onlinerl_operator.plan import (
    GATED_KINDS,
    MONITOR_KINDS,
    OPTIONAL_APIS,
    TRAINER_KINDS,
    applied_children,
    plan_problems,
    pod_template_problems,
)
from onlinerl_operator.redis_auth import ensure_redis_secret, redis_secret_problem
from onlinerl_operator.render import RenderContext, endpoints
from onlinerl_operator.render_scaling import stale_scaling
from onlinerl_operator.render_trainer import (
    JOBSET_API,
    REPLICATED_JOB,
    rendezvous_service,
    rendezvous_service_name,
    trainer_workload,
    world_size,
)
from onlinerl_operator.spec import SpecError, parse_spec
from onlinerl_operator.status import (
    JobStatus,
    Observation,
    Reason,
    decision_text,
    derive_conditions,
    derive_phase,
    epoch_from_iso,
    iso_from_epoch,
    now_iso,
    project_lines_status,
    stamp_conditions,
)

log = logging.getLogger("onlinerl.operator")
# Children removed on deletion (owner references make the garbage collector do it too), found by label.
CHILD_KINDS = (
    "Ingress",
    "HorizontalPodAutoscaler",
    "ScaledObject",
    "PodDisruptionBudget",
    "JobSet",
    "Job",
    "Deployment",
    "Service",
    "StatefulSet",
    "ConfigMap",
    "PersistentVolumeClaim",
    *MONITOR_KINDS,
)
# What "the data plane cannot be reached" looks like: anything else is a bug and must surface as one.
DATA_PLANE_ERRORS = (RedisError, OSError, LookupError)


@dataclass
class StepFailure(Exception):
    """A reconcile step the Kubernetes API refused: typed reason, a message that says what to do, and when to try
    again (``retry_after`` seconds; a spec change retries at once)."""

    step: str
    reason: Reason
    message: str
    retry_after: float

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class RetryPolicy:
    """Seconds before a refused step is tried again, by kind of refusal (tests shorten them)."""

    forbidden: float = 60.0  # RBAC: an admin can grant the verb without touching the spec
    invalid: float = 300.0  # 400/422: the spec must change (or an admission policy): look again now and then
    conflict: float = 1.0  # someone else wrote first: read again and retry at once
    unavailable: float = 5.0  # 429/5xx/anything else


def classify(step: str, exc: KubeError, retry: RetryPolicy = RetryPolicy()) -> StepFailure:
    """From an API refusal to its typed reason and retry policy."""
    if exc.status == 403:
        return StepFailure(
            step,
            Reason.API_FORBIDDEN,
            f"{step}: forbidden ({exc}); grant the operator's ServiceAccount this verb (operator/rbac.yaml, the "
            f"chart's RBAC); retried every {retry.forbidden:g} s",
            retry.forbidden,
        )
    if exc.status in (400, 422):
        return StepFailure(
            step,
            Reason.API_INVALID,
            f"{step}: the API refused the object ({exc}); fix the spec field it names (retried on a spec change, "
            f"and every {retry.invalid:g} s in case an admission policy changed)",
            retry.invalid,
        )
    if exc.status == 409:
        return StepFailure(step, Reason.API_CONFLICT, f"{step}: conflict ({exc}); retrying", retry.conflict)
    return StepFailure(
        step,
        Reason.API_UNAVAILABLE,
        f"{step}: API unavailable ({exc}); retrying in {retry.unavailable:g} s",
        retry.unavailable,
    )


class DataPlaneUnavailable(RuntimeError):
    """The job's Redis cannot be reached: a one-shot spec field waits for it (the handler retries)."""


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
    """Drive the trainer workload (Job, Indexed Job or JobSet) toward the spec: create, suspend/resume, replace on
    change, retry on failure."""
    desired = trainer_workload(ctx)
    kind = desired["kind"]
    ns, name = ctx.namespace, desired["metadata"]["name"]
    t = ctx.cfg.trainer
    if kind not in TRAINER_KINDS or (kind in GATED_KINDS and GATED_KINDS[kind] not in ctx.apis):
        book.state, book.message = "pending", f"trainer not created: {kind} is not served by this cluster"
        return book
    for other in TRAINER_KINDS:
        # The spec moved between a Job and a JobSet: the old one goes first (two trainers must never publish at once).
        if other == kind or (other in GATED_KINDS and GATED_KINDS[other] not in ctx.apis):
            continue
        previous = await kube.get(other, ns, name)
        if previous is not None:
            if not (previous.get("metadata") or {}).get("deletionTimestamp"):
                await kube.delete(other, ns, name, propagation="Foreground")
            book.state, book.message = "pending", f"waiting for the previous trainer {other} {name} to be gone"
            return book
    job = await kube.get(kind, ns, name)
    if job is not None and (job.get("metadata") or {}).get("deletionTimestamp"):
        # Deleted in the foreground: the Job stays until its pod is gone. Two trainers must never publish at once.
        book.state = "pending"
        book.message = f"waiting for the previous trainer Job {name} and its pod to be gone"
        return book
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
        # A Job's pod template is immutable: replace it. The new trainer resumes from the latest checkpoint, and is
        # created only once the old pod is gone (foreground deletion), so two trainers never publish at once.
        await kube.delete(kind, ns, name, propagation="Foreground")
        book.state, book.message = "pending", f"trainer {kind} replaced for the new spec"
        return book
    if bool((job.get("spec") or {}).get("suspend")) != t.suspend:
        await kube.patch(kind, ns, name, {"spec": {"suspend": t.suspend}})
        job.setdefault("spec", {})["suspend"] = t.suspend
    if _job_condition(job, "Failed"):  # Job and JobSet alike
        if book.restarts >= t.max_restarts:
            book.state = "failed"
            book.message = (
                f"trainer Job failed {book.restarts + 1} times (trainer.maxRestarts={t.max_restarts}); "
                f"see `kubectl logs job/{name}`; any spec change retries"
            )
            return book
        await kube.delete(kind, ns, name, propagation="Foreground")
        delay = t.restart_backoff_seconds * (2**book.restarts)
        book.restarts += 1
        book.retry_after = now + delay
        book.state = "retrying"
        book.message = f"trainer Job failed; restart {book.restarts}/{t.max_restarts} in {delay:.0f}s"
        return book
    st = job.get("status") or {}
    if _job_condition(job, "Complete") or _job_condition(job, "Completed"):  # Job / JobSet
        book.state, book.message = "completed", "trainer exited successfully; it stops learning until restarted"
    elif t.suspend:
        book.state, book.message = "suspended", "trainer suspended (spec.trainer.suspend); serving continues"
    elif (st.get("ready") or st.get("active") or 0) > 0 or any(
        (r.get("active") or r.get("ready") or 0) > 0 for r in st.get("replicatedJobsStatus") or []
    ):
        book.state, book.message = "running", f"trainer Job {name} running"
    else:
        book.state, book.message = "pending", f"trainer Job {name} waiting for its pod"
    return book


async def ready_nodes(kube: Kube, ctx: RenderContext) -> int:
    """Trainer pods (nodes) ready now: the Job's ``status.ready``; a JobSet's from its one child Job."""
    kind, name = trainer_workload(ctx)["kind"], ctx.child("trainer")
    if kind == "JobSet":
        if JOBSET_API not in ctx.apis:
            return 0
        name = f"{name}-{REPLICATED_JOB}-0"  # <jobset>-<replicatedJob>-<index>
    job = await kube.get("Job", ctx.namespace, name)
    return int(((job or {}).get("status") or {}).get("ready") or 0)


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


def conflict_message(conflicts: list[str]) -> str:
    return "podTemplate asks to change what the operator owns (its value is kept): " + "; ".join(conflicts)


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


def _owned_by(obj: dict[str, Any] | None, owner_uid: str) -> bool:
    owners = ((obj or {}).get("metadata") or {}).get("ownerReferences") or []
    return obj is not None and any(o.get("uid") == owner_uid and o.get("kind") == c.KIND for o in owners)


@dataclass
class Pass:
    """One reconcile pass: its inputs and what the steps observed so far."""

    ctx: RenderContext
    old: dict[str, Any]
    apply: bool
    now: float
    book: TrainerBook
    obs: Observation
    extra: dict[str, Any] = field(default_factory=dict)


Step = Callable[[Pass], Awaitable[None]]


class Reconciler:
    """Holds the client; one instance per operator process. ``steps()`` is the reconcile, in order."""

    def __init__(self, kube: Kube, retry: RetryPolicy | None = None) -> None:
        self.kube = kube
        self.retry = retry or RetryPolicy()

    def steps(self) -> list[tuple[str, Step, bool]]:
        """``(name, step, mutates)`` in order. After a refused step, the mutating ones are skipped (they would act on
        a half-applied spec) and the observing ones still run, so the status stays true."""
        return [
            ("children", self.reconcile_children, True),
            ("spec problems", self.observe_spec_problems, False),
            ("trainer", self.reconcile_trainer, True),
            ("components", self.observe_components, False),
            ("data plane", self.observe_data_plane, False),
        ]

    async def monitoring_api(self) -> bool:
        """Whether monitoring.coreos.com/v1 is served; a refused discovery call means "no", never a failed pass."""
        try:
            return await self.kube.api_served()
        except (KubeError, OSError):
            return False

    async def served_apis(self) -> frozenset[str]:
        """Which of :data:`OPTIONAL_APIS` this cluster serves (discovery; a refused call counts as not served)."""
        served = set()
        for group_version in OPTIONAL_APIS:
            try:
                if await self.kube.api_served(f"/apis/{group_version}"):
                    served.add(group_version)
            except (KubeError, OSError):
                pass
        return frozenset(served)

    async def write_status(self, ns: str, name: str, status: dict[str, Any], old: dict[str, Any]) -> None:
        """Merge-patch the status subresource, but only when it changed: every write is a watch event for every
        client of this object (kopf included), so an unchanged status is not rewritten on each observe tick."""
        if _without_nulls(status) != old:
            await self.kube.patch("OnlineRLJob", ns, name, {"status": status}, subresource="status")

    async def _context(self, ns: str, name: str) -> tuple[dict[str, Any], RenderContext] | None:
        """The object read fresh and its render context; None when it is gone, being deleted, or invalid."""
        body = await self.kube.get("OnlineRLJob", ns, name)
        if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
            return None
        try:
            cfg = parse_spec(name, body.get("spec"))
        except SpecError:
            return None
        meta = body.get("metadata") or {}
        ctx = RenderContext(
            name=name,
            namespace=ns,
            uid=meta.get("uid", ""),
            cfg=cfg,
            monitoring_api=await self.monitoring_api(),
            apis=await self.served_apis(),
        )
        return body, ctx

    async def reconcile(self, ns: str, name: str, apply: bool) -> dict[str, Any] | None:
        """Run the steps in order, compose the status, write it if it changed; returns it (None if the object is
        gone). Raises :class:`StepFailure` after writing the status when a step was refused."""
        body = await self.kube.get("OnlineRLJob", ns, name)
        if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
            return None
        meta, old = body.get("metadata") or {}, body.get("status") or {}
        generation = meta.get("generation")
        if not apply and (old.get("observedGeneration") is None or old.get("observedGeneration") != generation):
            return None  # the spec handler has not applied this generation yet: nothing consistent to observe
        try:
            cfg = parse_spec(name, body.get("spec"))
        except SpecError as exc:
            if not apply:
                return None  # already reported as Invalid by the spec handler
            obs = Observation(generation=generation, invalid=str(exc))
            extra = {"trainerRestarts": int(old.get("trainerRestarts") or 0)}
            status = compose_status(old, obs, generation, extra, now_iso())
            await self.write_status(ns, name, status, old)
            return status
        ctx = RenderContext(
            name=name,
            namespace=ns,
            uid=meta.get("uid", ""),
            cfg=cfg,
            monitoring_api=await self.monitoring_api(),
            apis=await self.served_apis(),
        )
        book = _book_from_status(old)
        if apply and generation is not None and old.get("observedGeneration") not in (None, generation):
            book = TrainerBook()  # a new spec earns a fresh retry budget
        p = Pass(ctx=ctx, old=old, apply=apply, now=time.time(), book=book, obs=Observation(generation=generation))
        failure: StepFailure | None = None
        for step_name, step, mutates in self.steps():
            if failure is not None and mutates:
                continue
            try:
                await step(p)
            except KubeError as exc:
                failure = failure or classify(step_name, exc, self.retry)
                p.obs.failure_reason, p.obs.failure_message = failure.reason, failure.message
        if failure is not None and p.obs.trainer_state == "absent":
            p.obs.trainer_state, p.obs.trainer_message = "pending", f"not reconciled: {failure.step} step refused"
        observed = generation if apply and failure is None else old.get("observedGeneration")
        status = compose_status(old, p.obs, observed, {**carried_figures(old), **p.extra}, now_iso())
        await self.write_status(ns, name, status, old)
        if failure is not None:
            raise failure
        return status

    # --- the steps ------------------------------------------------------------------------------------------------
    async def reconcile_children(self, p: Pass) -> None:
        """Server-side apply every child except the trainer Job (the next step owns it); delete stale ones."""
        if not p.apply:
            return
        ctx = p.ctx
        await ensure_redis_secret(self.kube, ctx)  # the users' Secret, before the pods reading it
        for manifest in applied_children(ctx):  # not the trainer (the next step), only kinds this cluster serves
            verb = await self.kube.apply(manifest)
            log.debug("%s %s/%s", verb, manifest["kind"], manifest["metadata"]["name"])
        # Children an earlier spec wanted and this one does not (only ones we own: never a user's claim).
        stale: list[tuple[str, str]] = []
        if not ctx.monitors_enabled and ctx.monitoring_api:
            stale += [("ServiceMonitor", ctx.name), ("PodMonitor", ctx.child("reloader"))]
        if ctx.cfg.storage.existing_claim:
            stale.append(("PersistentVolumeClaim", ctx.child("checkpoints")))
        if not ctx.in_cluster_redis:
            stale += [
                ("StatefulSet", ctx.child("redis")),
                ("Service", ctx.child("redis")),
                ("NetworkPolicy", ctx.child("redis")),
                ("ConfigMap", ctx.child("redis-acl")),
            ]
        if not ctx.cfg.ingress.enabled:
            stale.append(("Ingress", ctx.name))
        stale += [k for k in stale_scaling(ctx) if k[0] not in GATED_KINDS or GATED_KINDS[k[0]] in ctx.apis]
        if rendezvous_service(ctx) is None:  # one node, or a JobSet (which makes its own, owned by it)
            stale.append(("Service", rendezvous_service_name(ctx)))
        if not ctx.cfg.rollout.controlled:
            stale += [
                ("Deployment", ctx.child("rollout")),
                ("Service", ctx.child("rollout")),
                ("NetworkPolicy", ctx.child("rollout")),
            ]
        for kind, child in stale:
            await self.delete_owned(kind, ctx.namespace, child, ctx.uid)
        conflicts = pod_template_problems(ctx)
        if conflicts:  # an Event once per apply; the status says it on every pass (observe_spec_problems)
            await self.report_problem(ctx, p.obs.generation, Reason.POD_TEMPLATE_CONFLICT, conflict_message(conflicts))

    async def observe_spec_problems(self, p: Pass) -> None:
        """What the spec asks that this cluster cannot give, on every pass: the Redis users' Secret, the plan's
        problems, podTemplate conflicts. An observe pass (the timer) used to drop them, since only the apply that
        found them reported them: a missing Secret showed in the status for one interval, then vanished while it
        was still missing (tests/operator/test_redis_auth_operator.py)."""
        ctx = p.ctx
        redis_problem = await redis_secret_problem(self.kube, ctx)
        if redis_problem:
            p.obs.problems.append(redis_problem)
        p.obs.problems += plan_problems(ctx)
        conflicts = pod_template_problems(ctx)
        if conflicts:
            p.obs.problems.append(conflict_message(conflicts))
            p.obs.problem_reason = p.obs.problem_reason or Reason.POD_TEMPLATE_CONFLICT

    async def reconcile_trainer(self, p: Pass) -> None:
        p.book = await sync_trainer(self.kube, p.ctx, p.book, p.now)
        p.obs.trainer_state, p.obs.trainer_message = p.book.state, p.book.message
        p.extra["trainerRestarts"] = p.book.restarts
        p.extra["trainerRetryAfter"] = iso_from_epoch(p.book.retry_after) if p.book.retry_after else None
        p.extra["trainerNodes"] = p.ctx.cfg.trainer.nodes
        p.extra["trainerRanks"] = world_size(p.ctx)
        p.extra["trainerReadyNodes"] = await ready_nodes(self.kube, p.ctx)

    async def observe_components(self, p: Pass) -> None:
        ns = p.ctx.namespace
        p.obs.serving_ready, p.obs.serving_message = await deployment_ready(self.kube, ns, p.ctx.child("serving"))
        p.obs.feedback_ready, p.obs.feedback_message = await deployment_ready(self.kube, ns, p.ctx.child("feedback"))
        p.extra["endpoints"] = endpoints(p.ctx)

    async def observe_data_plane(self, p: Pass) -> None:
        """Figures for status and Events for new rollout decisions. An unreachable Redis degrades the job (the next
        observe tick looks again); the Secret holding an external Redis URL is read through the API (may refuse)."""
        ctx, old = p.ctx, p.old
        try:
            url = await redis_url(self.kube, ctx)  # LookupError: its Secret is missing (a KubeError still propagates)
            view = await read_view(
                url,
                ctx.name,
                decisions_after=old.get("lastDecisionId"),
                projects=ctx.cfg.projects,
                project_decisions_after=old.get("projectDecisionsAfter"),
            )
        except DATA_PLANE_ERRORS as exc:
            p.extra["redisReachable"] = False
            p.obs.problems.append(f"Redis not reachable ({type(exc).__name__}: {exc})")
            return
        await self.report_decisions(ctx, [(SHARED_LINE, i, d) for i, d in view.decisions])
        if view.decisions:
            last_id, last = view.decisions[-1]
            p.extra["lastDecisionId"] = last_id
            p.extra["lastDecision"] = decision_text(last.decision, last.version, last.actor, last.reason)[:1024]
        # Project lines (issue 39): their Events and status.projects; the shared line's fields above stay its own.
        await self.report_decisions(ctx, view.lines.decisions)
        decided = {line: decision_text(d.decision, d.version, d.actor, d.reason) for line, _, d in view.lines.decisions}
        p.extra["projects"] = project_lines_status(view.lines.tables, decided, old.get("projects")) or None
        p.extra["projectLines"] = len(view.lines.names) or None
        p.extra["projectDecisionsAfter"] = view.lines.cursor
        p.obs.last_decision = p.extra.get("lastDecision") or old.get("lastDecision") or ""
        p.obs.last_decision_kind = p.obs.last_decision.split(" ", 1)[0]
        policy = view.policy
        p.obs.stable_version = policy.stable if policy else None
        p.obs.candidate_version = policy.candidate if policy else None
        p.extra.update(
            {
                "redisReachable": True,
                "stableVersion": p.obs.stable_version,
                "candidateVersion": p.obs.candidate_version,
                "pinnedVersion": policy.pinned if policy else None,
                "canaryShare": policy.canary_share if policy else None,
                "previewVersion": policy.previewing(time.time()) if policy else None,
                "acceptRate": view.accept_rate,
                "shown": view.shown,
                "samplesTrained": view.samples_trained,
                "trainerStep": view.trainer_step,
                "lastCheckpointTime": iso_from_epoch(view.last_checkpoint_at) if view.last_checkpoint_at else None,
            }
        )

    # --- one-shot spec fields (kopf field handlers) -----------------------------------------------------------------
    async def _data_plane_url(self, ns: str, name: str) -> str | None:
        found = await self._context(ns, name)
        return None if found is None else await redis_url(self.kube, found[1])

    async def apply_policy_field(self, ns: str, name: str, field_name: str, value: str) -> bool:
        """Write ``pinned``/``paused`` of the policy table once (a spec field changed). Returns whether it changed;
        raises :class:`DataPlaneUnavailable` when Redis cannot be reached (the handler retries)."""
        url = await self._data_plane_url(ns, name)
        if url is None:
            return False
        try:
            changed = await write_policy_field(url, name, field_name, value)
        except DATA_PLANE_ERRORS as exc:
            raise DataPlaneUnavailable(f"Redis not reachable ({type(exc).__name__}: {exc})") from exc
        if changed:
            log.info("%s/%s: policy %s=%r (spec.rollout)", ns, name, field_name, value)
        return changed

    async def apply_rollback(self, ns: str, name: str, version: int) -> str:
        """spec.rollout.rollbackTo, once per value: the CLI's rollback. Returns a problem ("" when done) and records
        ``appliedRollbackTo`` in status."""
        body = await self.kube.get("OnlineRLJob", ns, name)
        if ((body or {}).get("status") or {}).get("appliedRollbackTo") == version:
            return ""  # carried out already: kopf may deliver one field change more than once
        url = await self._data_plane_url(ns, name)
        if url is None:
            return ""
        try:
            problem = await manual_rollback(url, name, version)
        except DATA_PLANE_ERRORS as exc:
            raise DataPlaneUnavailable(f"Redis not reachable ({type(exc).__name__}: {exc})") from exc
        if not problem:
            log.info("%s/%s: rolled back to v%s (spec.rollout.rollbackTo)", ns, name, version)
            await self.kube.patch("OnlineRLJob", ns, name, {"status": {"appliedRollbackTo": version}}, "status")
        return problem

    # --- Events and deletion ------------------------------------------------------------------------------------------
    async def report_decisions(self, ctx: RenderContext, decisions: list[tuple[str, str, Any]]) -> None:
        """One Kubernetes Event per rollout decision (gate, promote, rollback, pin...) of ``(line, stream id,
        record)``, on the OnlineRLJob (:func:`decision_event`)."""
        for line, entry_id, d in decisions:
            event = decision_event(ctx, line, entry_id, d)
            try:
                await self.kube.create(event)
            except KubeError as exc:
                log.warning("%s/%s: could not post the rollout event: %s", ctx.namespace, ctx.name, exc)

    async def report_problem(self, ctx: RenderContext, generation: int | None, reason: Reason, message: str) -> None:
        """One Warning Event per spec generation and reason (named after both: a later pass gets 409, no duplicate)."""
        name = f"{ctx.name}.{reason.value.lower()}.{generation or 0}"
        try:
            await self.kube.create(job_event(ctx, name, reason.value, message, warning=True, when=now_iso()))
        except KubeError as exc:
            log.warning("%s/%s: could not post the %s event: %s", ctx.namespace, ctx.name, reason.value, exc)

    async def delete_owned(self, kind: str, ns: str, name: str, owner_uid: str) -> bool:
        """Delete ``kind/name`` only if its owner reference points at ``owner_uid``."""
        if not _owned_by(await self.kube.get(kind, ns, name), owner_uid):
            return False
        return await self.kube.delete(kind, ns, name)

    async def cleanup(self, ns: str, name: str, uid: str) -> list[str]:
        """Delete every child of a deleted job that it owns, found by its labels (so a child kind or name added later
        is never forgotten). Redis data and the policy table stay."""
        deleted = []
        monitoring = await self.monitoring_api()
        wanted = {c.LABEL_JOB: name, c.LABEL_MANAGED_BY: c.MANAGER}
        for kind in CHILD_KINDS:
            if kind in MONITOR_KINDS and not monitoring:
                continue
            for obj in await self.kube.list_labelled(kind, ns, wanted):
                child = obj["metadata"]["name"]
                if _owned_by(obj, uid) and await self.kube.delete(kind, ns, child, propagation="Foreground"):
                    deleted.append(f"{kind}/{child}")
        return deleted


def job_event(ctx: RenderContext, name: str, reason: str, message: str, warning: bool, when: str) -> dict[str, Any]:
    """A core/v1 Event on the OnlineRLJob, named by the caller (a stable name makes a repeat a 409, not a copy)."""
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": name, "namespace": ctx.namespace},
        "involvedObject": {
            "apiVersion": c.API_VERSION,
            "kind": c.KIND,
            "name": ctx.name,
            "namespace": ctx.namespace,
            "uid": ctx.uid,
        },
        "reason": reason,
        "message": message[:1024],
        "type": "Warning" if warning else "Normal",
        "source": {"component": c.MANAGER},
        "firstTimestamp": when,
        "lastTimestamp": when,
        "count": 1,
    }


def decision_event(ctx: RenderContext, line: str, entry_id: str, d: Any) -> dict[str, Any]:
    """The Event of one rollout decision. The shared line's: reason ``Rollout<Kind>``; a project line's:
    ``ProjectRollout<Kind>``, its message starting ``project <name>:`` (``kubectl get events`` tells them apart).

    Named after the line and the decision's stream id, not kopf's generated names: an operator restart that reports
    the same decision again gets 409 instead of a duplicate Event. A project's name may hold capitals and ``_``, which
    an object name may not: it is named by a lowercase form and a digest of the exact name, so two projects never
    share a name."""
    kind = "Rollout" + "".join(part.capitalize() for part in d.decision.split("_"))
    message = f"v{d.version} (stable v{d.stable}) by {d.actor}: {d.reason}"
    name = f"{ctx.name}.rollout.{entry_id.replace('-', '.')}"
    if line:
        slug = re.sub(r"[^a-z0-9]+", "-", line.lower()).strip("-")[:40] or "p"
        digest = hashlib.sha256(line.encode()).hexdigest()[:8]
        name = f"{ctx.name}.rollout.{slug}-{digest}.{entry_id.replace('-', '.')}"
        kind, message = "Project" + kind, f"project {line}: {message}"
    warning = d.decision in ("rollback", "gate_fail")
    return job_event(ctx, name, kind, message, warning=warning, when=iso_from_epoch(d.at))


def carried_figures(old: dict[str, Any]) -> dict[str, Any]:
    """Status fields a pass keeps from the last one unless a step refreshes them (the last known figures while Redis
    is unreachable, the rollback already applied, the retry bookkeeping)."""
    keys = (
        "trainerRestarts",
        "trainerRetryAfter",
        "trainerNodes",
        "trainerRanks",
        "trainerReadyNodes",
        "endpoints",
        "appliedRollbackTo",
        "lastDecisionId",
        "lastDecision",
        "stableVersion",
        "candidateVersion",
        "pinnedVersion",
        "canaryShare",
        "acceptRate",
        "shown",
        "samplesTrained",
        "trainerStep",
        "lastCheckpointTime",
        "projects",
        "projectLines",
        "projectDecisionsAfter",
    )
    return {k: old[k] for k in keys if old.get(k) is not None}
