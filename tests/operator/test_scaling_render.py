"""Autoscalers, PodDisruptionBudgets and topology spread as the operator renders them: valid Kubernetes (strict,
1.29 and 1.33), the metric each cluster can serve, and nothing that fights the autoscaler over ``replicas``."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest

from onlinerl_operator.render import RenderContext, render_all
from onlinerl_operator.render_scaling import CUSTOM_METRICS_API, KEDA_API, quantity, stale_scaling
from onlinerl_operator.spec import SpecError, parse_spec

UID = "0b5c1a7e-2f62-4a8e-9d1e-3f1f6f3c8a11"
K8S = ("1.29", "1.33")
APIS = {
    "plain": frozenset(),
    "custom-metrics": frozenset({CUSTOM_METRICS_API}),
    "keda": frozenset({KEDA_API}),
}
SCALED = {
    "auth": {"allowAnonymous": True},
    "serving": {"replicas": 2},
    "feedback": {"replicas": 2},
    "scaling": {
        "serving": {"autoscale": {"enabled": True, "minReplicas": 2, "maxReplicas": 6, "targetLoad": 2.5}},
        "feedback": {"autoscale": {"enabled": True, "maxReplicas": 3}, "maxUnavailable": 2},
        "prometheusUrl": "http://prometheus-operated.monitoring:9090",
    },
}


def ctx(spec: dict[str, Any], apis: frozenset[str] = frozenset()) -> RenderContext:
    return RenderContext(name="demo", namespace="team-a", uid=UID, cfg=parse_spec("demo", spec), apis=apis)


def objs(c: RenderContext) -> dict[tuple[str, str], dict[str, Any]]:
    return {(m["kind"], m["metadata"]["name"]): m for m in render_all(c)}


@pytest.mark.parametrize("apis", sorted(APIS))
def test_scaling_objects_validate_strictly(apis: str) -> None:
    manifests = render_all(ctx(SCALED, APIS[apis]))
    kinds = {m["kind"] for m in manifests}
    assert "PodDisruptionBudget" in kinds
    assert ("ScaledObject" in kinds) == (apis == "keda") and ("HorizontalPodAutoscaler" in kinds) == (apis != "keda")
    for m in manifests:
        if m["kind"] in ("ServiceMonitor", "PodMonitor", "ScaledObject"):
            continue
        for version in K8S:
            kubernetes_validate.validate(m, version, strict=True)


def test_hpa_uses_the_pods_load_metric_only_where_custom_metrics_are_served() -> None:
    plain = objs(ctx(SCALED))[("HorizontalPodAutoscaler", "demo-serving")]["spec"]
    assert plain["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "demo-serving"}
    assert (plain["minReplicas"], plain["maxReplicas"]) == (2, 6)
    assert plain["metrics"] == [
        {"type": "Resource", "resource": {"name": "cpu", "target": {"type": "Utilization", "averageUtilization": 70}}}
    ]
    custom = objs(ctx(SCALED, APIS["custom-metrics"]))
    assert custom[("HorizontalPodAutoscaler", "demo-serving")]["spec"]["metrics"] == [
        {
            "type": "Pods",
            "pods": {
                "metric": {"name": "onlinerl_serving_inflight_requests"},
                "target": {"type": "AverageValue", "averageValue": "2500m"},
            },
        }
    ]
    feedback = custom[("HorizontalPodAutoscaler", "demo-feedback")]["spec"]
    assert feedback["metrics"][0]["pods"]["metric"]["name"] == "onlinerl_feedback_responses"
    assert feedback["metrics"][0]["pods"]["target"]["averageValue"] == "20"  # the feedback default: 20 req/s per pod
    # metric: cpu stays on CPU even where custom metrics are served.
    cpu = {
        **SCALED,
        "scaling": {"serving": {"autoscale": {"enabled": True, "metric": "cpu", "targetCpuUtilization": 55}}},
    }
    metric = objs(ctx(cpu, APIS["custom-metrics"]))[("HorizontalPodAutoscaler", "demo-serving")]["spec"]["metrics"]
    assert metric[0]["resource"]["target"]["averageUtilization"] == 55


def test_keda_scaled_object_queries_this_jobs_load_from_prometheus() -> None:
    found = objs(ctx(SCALED, APIS["keda"]))
    assert ("HorizontalPodAutoscaler", "demo-serving") not in found  # KEDA makes its own HPA: never two
    so = found[("ScaledObject", "demo-serving")]
    assert so["apiVersion"] == "keda.sh/v1alpha1" and so["metadata"]["ownerReferences"][0]["uid"] == UID
    assert so["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "demo-serving"}
    assert (so["spec"]["minReplicaCount"], so["spec"]["maxReplicaCount"]) == (2, 6)
    (trigger,) = so["spec"]["triggers"]
    assert trigger == {
        "type": "prometheus",
        "metadata": {
            "serverAddress": "http://prometheus-operated.monitoring:9090",
            "query": 'sum(onlinerl_serving_inflight_requests{namespace="team-a",onlinerl_dev_job="demo"})',
            "threshold": "2.5",
        },
    }
    feedback = found[("ScaledObject", "demo-feedback")]["spec"]["triggers"][0]["metadata"]
    assert (
        feedback["query"]
        == 'sum(rate(onlinerl_feedback_responses_total{namespace="team-a",onlinerl_dev_job="demo"}[1m]))'
    )
    # Without a Prometheus URL KEDA scales on CPU.
    no_prom = {**SCALED, "scaling": {**SCALED["scaling"], "prometheusUrl": ""}}
    so = objs(ctx(no_prom, APIS["keda"]))[("ScaledObject", "demo-serving")]
    assert so["spec"]["triggers"] == [{"type": "cpu", "metricType": "Utilization", "metadata": {"value": "70"}}]


def test_autoscaled_deployments_leave_replicas_to_the_autoscaler_and_spread() -> None:
    found = objs(ctx(SCALED))
    for component in ("serving", "feedback"):
        dep = found[("Deployment", f"demo-{component}")]
        assert "replicas" not in dep["spec"], component  # a server-side apply with it would undo every scale
        constraints = dep["spec"]["template"]["spec"]["topologySpreadConstraints"]
        assert [c["topologyKey"] for c in constraints] == ["topology.kubernetes.io/zone", "kubernetes.io/hostname"]
        for constraint in constraints:
            assert constraint["whenUnsatisfiable"] == "ScheduleAnyway" and constraint["maxSkew"] == 1
            assert constraint["labelSelector"]["matchLabels"] == {
                "onlinerl.dev/job": "demo",
                "onlinerl.dev/component": component,
            }
            assert constraint["matchLabelKeys"] == ["pod-template-hash"]
    pdbs = {k[1]: v["spec"] for k, v in found.items() if k[0] == "PodDisruptionBudget"}
    assert pdbs["demo-serving"]["maxUnavailable"] == 1 and pdbs["demo-feedback"]["maxUnavailable"] == 2
    assert pdbs["demo-serving"]["selector"]["matchLabels"]["onlinerl.dev/component"] == "serving"


def test_one_replica_gets_no_budget_no_spread_and_keeps_its_replicas() -> None:
    """The default (one pod each, no autoscaler): nothing new, so an existing job's pods do not roll."""
    found = objs(ctx({"auth": {"allowAnonymous": True}}))
    assert not {k for k in found if k[0] in ("PodDisruptionBudget", "HorizontalPodAutoscaler", "ScaledObject")}
    dep = found[("Deployment", "demo-serving")]
    assert dep["spec"]["replicas"] == 1 and "topologySpreadConstraints" not in dep["spec"]["template"]["spec"]
    assert set(stale_scaling(ctx({"auth": {"allowAnonymous": True}}))) == {
        (kind, f"demo-{component}")
        for kind in ("HorizontalPodAutoscaler", "ScaledObject", "PodDisruptionBudget")
        for component in ("serving", "feedback")
    }
    # Two fixed replicas: a budget and a spread, no autoscaler; spread can be switched off or made strict.
    two = {"auth": {"allowAnonymous": True}, "serving": {"replicas": 2}}
    found = objs(ctx(two))
    assert ("PodDisruptionBudget", "demo-serving") in found and ("PodDisruptionBudget", "demo-feedback") not in found
    assert found[("Deployment", "demo-serving")]["spec"]["replicas"] == 2
    strict = {
        **two,
        "scaling": {"spread": {"whenUnsatisfiable": "DoNotSchedule", "topologyKeys": ["kubernetes.io/hostname"]}},
    }
    (constraint,) = objs(ctx(strict))[("Deployment", "demo-serving")]["spec"]["template"]["spec"][
        "topologySpreadConstraints"
    ]
    assert constraint["whenUnsatisfiable"] == "DoNotSchedule"
    off = objs(ctx({**two, "scaling": {"spread": {"enabled": False}}}))
    assert "topologySpreadConstraints" not in off[("Deployment", "demo-serving")]["spec"]["template"]["spec"]


@pytest.mark.parametrize(
    ("scaling", "field"),
    [
        (
            {"serving": {"autoscale": {"minReplicas": 5, "maxReplicas": 2}}},
            "maxReplicas (2) must be >= minReplicas (5)",
        ),
        ({"serving": {"autoscale": {"minReplicas": 0}}}, "scaling.serving.autoscale.minReplicas"),
        ({"feedback": {"autoscale": {"targetLoad": -1}}}, "scaling.feedback.autoscale.targetLoad"),
        ({"serving": {"maxUnavailable": 0}}, "scaling.serving.maxUnavailable"),
        ({"serving": {"autoscale": {"provider": "knative"}}}, "scaling.serving.autoscale.provider"),
        ({"spread": {"whenUnsatisfiable": "Sometimes"}}, "scaling.spread.whenUnsatisfiable"),
        ({"spread": {"topologyKeys": [f"k{i}" for i in range(9)]}}, "scaling.spread.topologyKeys"),
        ({"serving": {"autoscale": {"enabled": True, "bogus": 1}}}, "scaling.serving.autoscale.bogus"),
    ],
)
def test_bad_scaling_fields_are_refused_naming_the_field(scaling: dict[str, Any], field: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_spec("demo", {"auth": {"allowAnonymous": True}, "scaling": scaling})
    assert field in str(err.value)


def test_quantity() -> None:
    assert [quantity(v) for v in (4.0, 2.5, 0.1, 20, 1234.5678)] == ["4", "2500m", "100m", "20", "1234568m"]


def test_a_scaling_change_restarts_no_pod_and_replaces_no_trainer() -> None:
    """Only the Kubernetes objects change: the pods' config hash and the trainer's spec hash stay."""
    base = {"auth": {"allowAnonymous": True}}
    before, after = objs(ctx(base)), objs(ctx({**base, "scaling": {"feedback": {"autoscale": {"maxReplicas": 7}}}}))
    hash_key = "onlinerl.dev/config-hash"
    for kind, name in (("Deployment", "demo-serving"), ("Deployment", "demo-feedback"), ("Job", "demo-trainer")):
        template = before[(kind, name)]["spec"]["template"]
        assert after[(kind, name)]["spec"]["template"] == template, name
        assert template["metadata"]["annotations"][hash_key]
    spec_hash = "onlinerl.dev/spec-hash"
    job = ("Job", "demo-trainer")
    assert after[job]["metadata"]["annotations"][spec_hash] == before[job]["metadata"]["annotations"][spec_hash]
