"""kopf handlers, registered onto a given registry (one per test, the default one in production).

Thin by design: every decision lives in reconcile.py (I/O) and render.py/status.py/spec.py (pure). Handlers return
None so kopf writes no handler results into status; its progress and diff-base live in annotations (settings()).
Failures become kopf's typed retries here: a refused step (:class:`StepFailure`) and an unreachable data plane are
``kopf.TemporaryError`` with the delay of their kind (403 slow, 422 slower, 409 at once). Anything else is a bug and
propagates as one.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import kopf

from onlinerl_operator import constants as c
from onlinerl_operator.kube import Kube
from onlinerl_operator.metrics import RECONCILES, serve_health_and_metrics
from onlinerl_operator.reconcile import DataPlaneUnavailable, Reconciler, RetryPolicy, StepFailure

log = logging.getLogger("onlinerl.operator")
RESOURCE = (c.GROUP, c.VERSION, c.PLURAL)


def configure(settings: kopf.OperatorSettings) -> None:
    """Keep kopf's bookkeeping out of status: progress and diff-base go to annotations."""
    settings.persistence.finalizer = f"{c.GROUP}/cleanup"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=c.KOPF_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=c.KOPF_PREFIX, key="last-handled-configuration"
    )
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    # On exit give a running observe pass time to finish its writes instead of orphaning it.
    settings.background.instant_exit_timeout = 3.0


def _locks(memo: Any) -> dict[str, asyncio.Lock]:
    return memo.setdefault("locks", {})


def build_registry(
    interval: float = 10.0, health_port: int | None = None, retry: RetryPolicy | None = None
) -> kopf.OperatorRegistry:
    """All handlers on a fresh registry. ``interval``: seconds between observe passes (status, trainer retries);
    ``retry``: delays before a step the API refused is tried again."""
    registry = kopf.OperatorRegistry()

    @kopf.on.startup(registry=registry)
    async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
        configure(settings)
        if memo.get("reconciler") is None:
            # Tests inject a factory (the client must be created inside the operator's own event loop).
            factory = memo.get("kube_factory")
            memo["reconciler"] = Reconciler(factory() if factory else await Kube.from_environment(), retry)
            memo["owns_client"] = True
        memo.setdefault("locks", {})
        if health_port:
            memo["health_server"] = await serve_health_and_metrics(health_port)

    @kopf.on.cleanup(registry=registry)
    async def cleanup(memo: kopf.Memo, **_: Any) -> None:
        if memo.get("health_server") is not None:
            await memo["health_server"].cleanup()
        if memo.get("owns_client"):
            await memo["reconciler"].kube.close()

    async def _run(memo: kopf.Memo, namespace: str, name: str, uid: str, apply: bool) -> None:
        kind = "spec" if apply else "observe"
        async with _locks(memo).setdefault(uid, asyncio.Lock()):
            try:
                await memo["reconciler"].reconcile(namespace, name, apply=apply)
            except StepFailure as failure:
                RECONCILES.labels(kind=kind, result=str(failure.reason)).inc()
                raise kopf.TemporaryError(failure.message, delay=failure.retry_after) from None
            except Exception:
                RECONCILES.labels(kind=kind, result="error").inc()
                raise
            RECONCILES.labels(kind=kind, result="ok").inc()

    async def _once(memo: kopf.Memo, uid: str, action: Any) -> None:
        """A one-shot spec field: under the object's lock (a status write must not interleave with a pass)."""
        async with _locks(memo).setdefault(uid, asyncio.Lock()):
            try:
                await action(memo["reconciler"])
            except DataPlaneUnavailable as exc:
                raise kopf.TemporaryError(f"{exc}; applied once Redis answers", delay=5) from None

    @kopf.on.resume(*RESOURCE, registry=registry, backoff=5)
    @kopf.on.create(*RESOURCE, registry=registry, backoff=5)
    @kopf.on.update(*RESOURCE, registry=registry, backoff=5)
    async def spec_changed(memo: kopf.Memo, namespace: str, name: str, uid: str, **_: Any) -> None:
        await _run(memo, namespace, name, uid, apply=True)

    # One-shot spec fields: applied once per change of the field (kopf keeps the last handled value), so a later
    # manual decision (`onlinerl policy unpin`, `resume`) sticks until the field changes again.
    @kopf.on.field(*RESOURCE, field="spec.rollout.pinnedVersion", registry=registry, backoff=5)
    async def pinned_version(new: Any, memo: kopf.Memo, namespace: str, name: str, uid: str, **_: Any) -> None:
        value = "" if new is None else str(int(new))
        await _once(memo, uid, lambda r: r.apply_policy_field(namespace, name, "pinned", value))

    @kopf.on.field(*RESOURCE, field="spec.rollout.paused", registry=registry, backoff=5)
    async def paused(new: Any, memo: kopf.Memo, namespace: str, name: str, uid: str, **_: Any) -> None:
        value = "1" if new else "0"
        await _once(memo, uid, lambda r: r.apply_policy_field(namespace, name, "paused", value))

    @kopf.on.field(*RESOURCE, field="spec.rollout.rollbackTo", registry=registry, backoff=5)
    async def rollback_to(new: Any, memo: kopf.Memo, namespace: str, name: str, uid: str, **_: Any) -> None:
        if new is None:
            return

        async def act(r: Reconciler) -> None:
            problem = await r.apply_rollback(namespace, name, int(new))
            if problem:
                kopf.warn(
                    {"metadata": {"name": name, "namespace": namespace, "uid": uid}},
                    reason="RollbackRefused",
                    message=problem,
                )

        await _once(memo, uid, act)

    @kopf.timer(*RESOURCE, registry=registry, interval=interval, initial_delay=interval)
    async def observe(memo: kopf.Memo, namespace: str, name: str, uid: str, **_: Any) -> None:
        await _run(memo, namespace, name, uid, apply=False)

    @kopf.on.delete(*RESOURCE, registry=registry, backoff=5)
    async def deleted(memo: kopf.Memo, namespace: str, name: str, uid: str, **_: Any) -> None:
        async with _locks(memo).setdefault(uid, asyncio.Lock()):
            gone = await memo["reconciler"].cleanup(namespace, name, uid)
        _locks(memo).pop(uid, None)
        log.info("%s/%s deleted; removed %s", namespace, name, ", ".join(gone) or "nothing")

    return registry
