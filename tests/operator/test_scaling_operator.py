"""kopf + the real handlers against kmock: autoscalers and disruption budgets follow the OnlineRLJob (created,
switched between HPA and KEDA, removed), a refused one is a typed condition and retried, deletion cleans up."""

from __future__ import annotations

from typing import Any

import pytest

from tests.operator.conftest import Cluster, wait_until
from tests.operator.test_reconcile_steps import applies, inject

pytestmark = pytest.mark.timeout(90)

AUTOSCALED = {
    "serving": {"replicas": 2},
    "scaling": {"serving": {"autoscale": {"enabled": True, "minReplicas": 2, "maxReplicas": 5}}},
}


def base_spec(url: str, **sections: Any) -> dict[str, Any]:
    return {"auth": {"allowAnonymous": True}, "redis": {"url": url}, **sections}


def serve_keda(cluster: Cluster) -> None:
    """The cluster serves keda.sh/v1alpha1 (what installing KEDA does to discovery)."""
    cluster.kmock.resources["keda.sh/v1alpha1/scaledobjects"] = cluster.kmock.ResourceInfo(
        kind="ScaledObject", namespaced=True, verbs={"get", "create", "patch", "delete", "list"}
    )


async def test_hpa_and_budget_follow_the_spec(cluster: Cluster, empty_valkey) -> None:
    body = await cluster.apply_job("demo", base_spec(empty_valkey.url, **AUTOSCALED))
    hpa = await wait_until(lambda: cluster.obj("HorizontalPodAutoscaler", "demo-serving"), what="serving HPA")
    assert hpa["spec"]["minReplicas"] == 2 and hpa["spec"]["maxReplicas"] == 5
    assert hpa["spec"]["metrics"][0]["resource"]["name"] == "cpu"  # no custom.metrics.k8s.io in this cluster
    assert hpa["metadata"]["ownerReferences"][0]["uid"] == body["metadata"]["uid"]
    pdb = await wait_until(lambda: cluster.obj("PodDisruptionBudget", "demo-serving"), what="serving PDB")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert cluster.obj("HorizontalPodAutoscaler", "demo-feedback") is None  # feedback: one pod, not autoscaled
    assert cluster.obj("PodDisruptionBudget", "demo-feedback") is None
    # The Deployment is applied without replicas (the HPA owns them), with its spread constraints.
    sent = applies(cluster, "apps/v1/deployments", "demo-serving") or [
        r for r in cluster.kmock if r.method.value == "POST" and r.resource == "apps/v1/deployments"
    ]
    assert sent and "replicas" not in sent[-1].data["spec"]
    assert len(sent[-1].data["spec"]["template"]["spec"]["topologySpreadConstraints"]) == 2

    # Raise the ceiling: the HPA is updated in place.
    scaling = {"serving": {"autoscale": {"enabled": True, "minReplicas": 2, "maxReplicas": 9}}}
    generation = await cluster.patch_spec("demo", {"scaling": scaling})
    await wait_until(lambda: cluster.status("demo").get("observedGeneration") == generation, what="applied")
    assert cluster.obj("HorizontalPodAutoscaler", "demo-serving")["spec"]["maxReplicas"] == 9

    # Autoscaling off and one replica: the HPA and the PDB go, the Deployment gets its replicas back.
    off = {"serving": {"autoscale": {"enabled": False}}}
    generation = await cluster.patch_spec("demo", {"scaling": off, "serving": {"replicas": 1}})
    await wait_until(lambda: cluster.status("demo").get("observedGeneration") == generation, what="applied")
    await wait_until(lambda: cluster.obj("HorizontalPodAutoscaler", "demo-serving") is None, what="HPA removed")
    await wait_until(lambda: cluster.obj("PodDisruptionBudget", "demo-serving") is None, what="PDB removed")
    assert cluster.obj("Deployment", "demo-serving")["spec"]["replicas"] == 1


async def test_keda_where_served_and_degraded_when_asked_for_but_absent(cluster: Cluster, empty_valkey) -> None:
    keda = {"serving": {"autoscale": {"enabled": True, "maxReplicas": 4, "provider": "keda"}}}
    await cluster.apply_job("demo", base_spec(empty_valkey.url, scaling=keda))
    degraded = await wait_until(
        lambda: (d := cluster.condition("demo", "Degraded")).get("status") == "True" and d, what="Degraded"
    )
    assert "scaling.serving.autoscale.provider=keda but keda.sh/v1alpha1 is not served" in degraded["message"]
    assert cluster.obj("HorizontalPodAutoscaler", "demo-serving") is None  # never a silent substitute

    serve_keda(cluster)
    generation = await cluster.patch_spec("demo", {"scaling": {**keda, "prometheusUrl": "http://prom:9090"}})
    so = await wait_until(lambda: cluster.obj("ScaledObject", "demo-serving"), what="ScaledObject")
    assert so["spec"]["triggers"][0]["type"] == "prometheus" and so["spec"]["maxReplicaCount"] == 4
    await wait_until(lambda: cluster.status("demo").get("observedGeneration") == generation, what="applied")
    await wait_until(lambda: cluster.condition("demo", "Degraded").get("status") == "False", what="healthy")

    # provider hpa: the ScaledObject goes (KEDA would keep its own HPA fighting ours), an HPA comes.
    hpa = {"serving": {"autoscale": {"enabled": True, "maxReplicas": 4, "provider": "hpa"}}}
    await cluster.patch_spec("demo", {"scaling": hpa})
    await wait_until(lambda: cluster.obj("HorizontalPodAutoscaler", "demo-serving"), what="HPA")
    await wait_until(lambda: cluster.obj("ScaledObject", "demo-serving") is None, what="ScaledObject removed")


async def test_a_refused_autoscaler_is_a_typed_condition_then_retried(cluster: Cluster, empty_valkey) -> None:
    # The first request for a new HPA: kmock answers the server-side apply of an absent object 404 (a real API server
    # would create it), so the operator's creation is the request an RBAC gap refuses. (kmock stores what it refuses,
    # so the retry's apply finds the object and succeeds: one refusal.)
    hit = inject(cluster, "POST", "autoscaling/v2/horizontalpodautoscalers", "demo-serving", 403, times=1)
    await cluster.apply_job("demo", base_spec(empty_valkey.url, **AUTOSCALED))
    degraded = await wait_until(
        lambda: (d := cluster.condition("demo", "Degraded")).get("reason") == "ApiForbidden" and d,
        what="Degraded/ApiForbidden",
    )
    assert degraded["message"].startswith("children: forbidden") and "horizontalpodautoscalers" in degraded["message"]
    await wait_until(lambda: cluster.obj("HorizontalPodAutoscaler", "demo-serving"), what="HPA after retry", timeout=20)
    await wait_until(lambda: cluster.condition("demo", "Degraded").get("reason") == "Healthy", what="recovered")
    assert len(hit) == 1


async def test_deleting_the_job_removes_its_scaling_objects(cluster: Cluster, empty_valkey) -> None:
    spec = base_spec(empty_valkey.url, **AUTOSCALED, feedback={"replicas": 3})
    await cluster.apply_job("demo", spec)
    for kind, name in (
        ("HorizontalPodAutoscaler", "demo-serving"),
        ("PodDisruptionBudget", "demo-serving"),
        ("PodDisruptionBudget", "demo-feedback"),
    ):
        await wait_until(lambda k=kind, n=name: cluster.obj(k, n), what=f"{kind} {name}")
    await cluster.delete_job("demo")
    await wait_until(lambda: cluster.job("demo") is None, what="job gone")
    assert cluster.obj("HorizontalPodAutoscaler", "demo-serving") is None
    assert cluster.obj("PodDisruptionBudget", "demo-serving") is None
    assert cluster.obj("PodDisruptionBudget", "demo-feedback") is None
