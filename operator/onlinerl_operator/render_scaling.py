"""Pure rendering of what lets serving and feedback outgrow one pod: autoscalers, PodDisruptionBudgets, spread.

- **Autoscaler** (``scaling.<component>.autoscale``): a KEDA ScaledObject where keda.sh/v1alpha1 is served (or asked
  for), else an HPA (autoscaling/v2). The load metric is per pod: in-flight requests of the gateway, requests per
  second of the feedback service. The HPA reads it as a Pods metric from custom.metrics.k8s.io (prometheus-adapter);
  KEDA queries Prometheus (``scaling.prometheusUrl``). Without either source both fall back to CPU utilization.
  An autoscaled Deployment is applied without ``spec.replicas``: the autoscaler owns that field.
- **PodDisruptionBudget** and **topologySpreadConstraints**: for a component that can run more than one pod.
"""

from __future__ import annotations

from typing import Any

from onlinerl.config import ComponentScalingConfig
from onlinerl_operator import constants as c
from onlinerl_operator.render import Manifest, RenderContext, metadata, selector

KEDA_API = "keda.sh/v1alpha1"
CUSTOM_METRICS_API = "custom.metrics.k8s.io/v1beta1"
SCALED = ("serving", "feedback")
# Per-pod load as prometheus-adapter exposes it (a counter's rate drops `_total`), and the whole job's load as
# Prometheus holds it (series carry `namespace` and the ServiceMonitor's target label `onlinerl_dev_job`).
POD_METRIC = {"serving": "onlinerl_serving_inflight_requests", "feedback": "onlinerl_feedback_responses"}
JOB_LABEL = c.LABEL_JOB.replace(".", "_").replace("/", "_")


def component_scaling(ctx: RenderContext, component: str) -> ComponentScalingConfig:
    return getattr(ctx.cfg.scaling, component)


def _replicas(ctx: RenderContext, component: str) -> int:
    return getattr(ctx.cfg, component).replicas


def autoscaled(ctx: RenderContext, component: str) -> bool:
    return component_scaling(ctx, component).autoscale.enabled


def can_run_several(ctx: RenderContext, component: str) -> bool:
    """More than one pod, now or once autoscaled: then a disruption budget and a spread mean something."""
    a = component_scaling(ctx, component).autoscale
    return (a.max_replicas > 1) if a.enabled else _replicas(ctx, component) > 1


def uses_keda(ctx: RenderContext, component: str) -> bool:
    provider = component_scaling(ctx, component).autoscale.provider
    return autoscaled(ctx, component) and (provider == "keda" or (provider == "auto" and KEDA_API in ctx.apis))


def prometheus_query(ctx: RenderContext, component: str) -> str:
    """The job's total load (KEDA divides it by the per-pod threshold)."""
    match = f'namespace="{ctx.namespace}",{JOB_LABEL}="{ctx.name}"'
    if component == "serving":
        return f"sum(onlinerl_serving_inflight_requests{{{match}}})"
    return f"sum(rate(onlinerl_feedback_responses_total{{{match}}}[1m]))"


def quantity(value: float) -> str:
    """A Kubernetes quantity: whole numbers as such, else in thousandths (``2.5`` -> ``2500m``)."""
    milli = round(value * 1000)
    return str(milli // 1000) if milli % 1000 == 0 else f"{milli}m"


def _cpu_metric(utilization: int) -> dict[str, Any]:
    target = {"type": "Utilization", "averageUtilization": utilization}
    return {"type": "Resource", "resource": {"name": "cpu", "target": target}}


def hpa_metrics(ctx: RenderContext, component: str) -> list[dict[str, Any]]:
    """The load metric as a Pods metric where custom.metrics.k8s.io is served; CPU utilization otherwise."""
    a = component_scaling(ctx, component).autoscale
    if a.metric == "load" and CUSTOM_METRICS_API in ctx.apis:
        return [
            {
                "type": "Pods",
                "pods": {
                    "metric": {"name": POD_METRIC[component]},
                    "target": {"type": "AverageValue", "averageValue": quantity(a.target_load)},
                },
            }
        ]
    return [_cpu_metric(a.target_cpu_utilization)]


def _target_ref(ctx: RenderContext, component: str) -> dict[str, str]:
    return {"apiVersion": "apps/v1", "kind": "Deployment", "name": ctx.child(component)}


def hpa(ctx: RenderContext, component: str) -> Manifest | None:
    if not autoscaled(ctx, component) or uses_keda(ctx, component):
        return None
    a = component_scaling(ctx, component).autoscale
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": metadata(ctx, ctx.child(component), component),
        "spec": {
            "scaleTargetRef": _target_ref(ctx, component),
            "minReplicas": a.min_replicas,
            "maxReplicas": a.max_replicas,
            "metrics": hpa_metrics(ctx, component),
        },
    }


def keda_triggers(ctx: RenderContext, component: str) -> list[dict[str, Any]]:
    a = component_scaling(ctx, component).autoscale
    if a.metric == "load" and ctx.cfg.scaling.prometheus_url:
        return [
            {
                "type": "prometheus",
                "metadata": {
                    "serverAddress": ctx.cfg.scaling.prometheus_url,
                    "query": prometheus_query(ctx, component),
                    "threshold": f"{a.target_load:g}",  # per pod: KEDA divides the query's total by it
                },
            }
        ]
    return [{"type": "cpu", "metricType": "Utilization", "metadata": {"value": str(a.target_cpu_utilization)}}]


def scaled_object(ctx: RenderContext, component: str) -> Manifest | None:
    if not uses_keda(ctx, component):
        return None
    a = component_scaling(ctx, component).autoscale
    return {
        "apiVersion": KEDA_API,
        "kind": "ScaledObject",
        "metadata": metadata(ctx, ctx.child(component), component),
        "spec": {
            "scaleTargetRef": _target_ref(ctx, component),
            "minReplicaCount": a.min_replicas,
            "maxReplicaCount": a.max_replicas,
            "triggers": keda_triggers(ctx, component),
        },
    }


def pod_disruption_budget(ctx: RenderContext, component: str) -> Manifest | None:
    if not can_run_several(ctx, component):
        return None
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata(ctx, ctx.child(component), component),
        "spec": {
            "maxUnavailable": component_scaling(ctx, component).max_unavailable,
            "selector": {"matchLabels": selector(ctx, component)},
        },
    }


def spread_constraints(ctx: RenderContext, component: str) -> list[dict[str, Any]]:
    """One constraint per topology key; ``pod-template-hash`` keeps a rollout's old pods out of the new ones' count."""
    s = ctx.cfg.scaling.spread
    if not s.enabled or not can_run_several(ctx, component):
        return []
    return [
        {
            "maxSkew": s.max_skew,
            "topologyKey": key,
            "whenUnsatisfiable": s.when_unsatisfiable,
            "labelSelector": {"matchLabels": selector(ctx, component)},
            "matchLabelKeys": ["pod-template-hash"],
        }
        for key in s.topology_keys
    ]


def shape_deployment(ctx: RenderContext, component: str, deployment: Manifest) -> Manifest:
    """The Deployment as applied: no ``replicas`` when autoscaled (the autoscaler owns it), its spread constraints."""
    if autoscaled(ctx, component):
        deployment["spec"].pop("replicas", None)
    constraints = spread_constraints(ctx, component)
    if constraints:
        deployment["spec"]["template"]["spec"]["topologySpreadConstraints"] = constraints
    return deployment


def scaling_manifests(ctx: RenderContext) -> list[Manifest]:
    out = []
    for component in SCALED:
        out += [hpa(ctx, component), scaled_object(ctx, component), pod_disruption_budget(ctx, component)]
    return [m for m in out if m is not None]


def stale_scaling(ctx: RenderContext) -> list[tuple[str, str]]:
    """(kind, name) of scaling objects an earlier spec may have made and this one does not want."""
    wanted = {(m["kind"], m["metadata"]["name"]) for m in scaling_manifests(ctx)}
    every = [
        (kind, ctx.child(component))
        for component in SCALED
        for kind in ("HorizontalPodAutoscaler", "ScaledObject", "PodDisruptionBudget")
    ]
    return [k for k in every if k not in wanted]


def scaling_problems(ctx: RenderContext) -> list[str]:
    """Asked-for APIs the cluster does not serve (the objects are skipped, the job shows Degraded)."""
    return [
        f"scaling.{component}.autoscale.provider=keda but {KEDA_API} is not served (install KEDA or use auto)"
        for component in SCALED
        if uses_keda(ctx, component) and KEDA_API not in ctx.apis
    ]
