"""What one reconcile pass applies, in order, as a pure function of the spec and of the optional APIs the cluster
serves. The reconciler (reconcile.py) and the offline render (`python -m onlinerl_operator render`, cli.py) both read
it, so what a review sees is what the operator does.

The cluster's answers are inputs (:class:`RenderContext` ``monitoring_api`` and ``apis``): the reconciler fills them
from discovery on every pass (``Reconciler.monitoring_api``, ``Reconciler.served_apis``), the offline render from its
command-line options.
"""

from __future__ import annotations

from onlinerl_operator.render import Manifest, RenderContext, pod_template_problems, render_all
from onlinerl_operator.render_scaling import CUSTOM_METRICS_API, KEDA_API, scaling_problems
from onlinerl_operator.render_trainer import JOBSET_API, trainer_problems, trainer_workload

MONITORING_API = "monitoring.coreos.com/v1"
MONITOR_KINDS = ("ServiceMonitor", "PodMonitor")
# API group/versions some children depend on, looked up in discovery on every pass (render_scaling, render_trainer).
OPTIONAL_APIS = (KEDA_API, JOBSET_API, CUSTOM_METRICS_API)
TRAINER_KINDS = ("Job", "JobSet")
# Kinds applied only where their API is served.
GATED_KINDS = {"ScaledObject": KEDA_API, "JobSet": JOBSET_API}


def served(ctx: RenderContext, manifest: Manifest) -> bool:
    """Whether the cluster serves ``manifest``'s API (monitors: monitoring.coreos.com; KEDA, JobSet: ``ctx.apis``)."""
    kind = manifest["kind"]
    if kind in MONITOR_KINDS:
        return ctx.monitoring_api
    return kind not in GATED_KINDS or GATED_KINDS[kind] in ctx.apis


def applied_children(ctx: RenderContext) -> list[Manifest]:
    """The children step's server-side applies, in order: every child but the trainer workload (the trainer step
    creates and replaces that one), and only kinds the cluster serves."""
    return [m for m in render_all(ctx) if m["kind"] not in TRAINER_KINDS and served(ctx, m)]


def applied_trainer(ctx: RenderContext) -> Manifest | None:
    """The trainer step's workload (Job, Indexed Job or JobSet); None where its API is not served."""
    workload = trainer_workload(ctx)
    return workload if workload["kind"] in TRAINER_KINDS and served(ctx, workload) else None


def apply_plan(ctx: RenderContext) -> list[Manifest]:
    """Everything a pass creates, in the order the steps do: the children, then the trainer."""
    trainer = applied_trainer(ctx)
    return applied_children(ctx) + ([trainer] if trainer is not None else [])


def plan_problems(ctx: RenderContext) -> list[str]:
    """What the job's Degraded condition says about the spec against this cluster (asked-for APIs not served)."""
    problems = scaling_problems(ctx) + trainer_problems(ctx)
    if ctx.cfg.monitoring.service_monitor == "on" and not ctx.monitoring_api:
        problems.append(
            f"monitoring.serviceMonitor=on but {MONITORING_API} is not served "
            "(install the Prometheus operator or use auto)"
        )
    return problems


__all__ = [
    "GATED_KINDS",
    "MONITORING_API",
    "MONITOR_KINDS",
    "OPTIONAL_APIS",
    "TRAINER_KINDS",
    "applied_children",
    "applied_trainer",
    "apply_plan",
    "plan_problems",
    "pod_template_problems",
    "served",
]
