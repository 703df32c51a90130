"""Pod templates through the running operator (kopf against kmock): what it applies carries the fragments, a
fragment that asks for the operator's own labels is a typed Degraded condition and one Warning Event (never a crash,
and the operator's labels stay), and a changed trainer template replaces the trainer Job (its pod template is
immutable) while serving's pods do not roll for it; and the offline render prints exactly what the operator applies."""

from __future__ import annotations

from typing import Any

import pytest

from onlinerl_operator import cli
from onlinerl_operator import constants as c
from onlinerl_operator.plan import apply_plan
from tests.operator.conftest import Cluster, wait_until

pytestmark = pytest.mark.timeout(90)

SCHEDULING = {"spec": {"nodeSelector": {"pool": "onlinerl"}, "imagePullSecrets": [{"name": "registry"}]}}


def spec(url: str, **sections: Any) -> dict[str, Any]:
    return {"auth": {"allowAnonymous": True}, "redis": {"url": url}, "podTemplate": SCHEDULING, **sections}


def events(cluster: Cluster, reason: str) -> list[dict[str, Any]]:
    return [
        e.raw
        for e in cluster.kmock.objects.values()
        if not e.deleted and e.raw.get("kind") == "Event" and e.raw.get("reason") == reason
    ]


async def test_applied_pods_carry_the_fragments_and_a_conflict_is_a_typed_condition(
    cluster: Cluster, empty_valkey
) -> None:
    hostile = {"metadata": {"labels": {c.LABEL_COMPONENT: "feedback"}}}  # would make serving pods feedback's
    await cluster.apply_job("demo", spec(empty_valkey.url, serving={"podTemplate": hostile}))
    degraded = await wait_until(
        lambda: (d := cluster.condition("demo", "Degraded")).get("reason") == "PodTemplateConflict" and d,
        what="Degraded/PodTemplateConflict",
    )
    assert degraded["status"] == "True"
    assert f"metadata.labels.{c.LABEL_COMPONENT}" in degraded["message"] and "demo-serving" in degraded["message"]
    assert cluster.status("demo")["phase"] == "Degraded"
    (event,) = events(cluster, "PodTemplateConflict")
    assert event["type"] == "Warning" and event["involvedObject"]["name"] == "demo"

    serving = cluster.obj("Deployment", "demo-serving")["spec"]["template"]
    assert serving["metadata"]["labels"][c.LABEL_COMPONENT] == "serving"  # the operator's value kept
    for kind, name in (("Deployment", "demo-serving"), ("Deployment", "demo-feedback"), ("Job", "demo-trainer")):
        pod = cluster.obj(kind, name)["spec"]["template"]["spec"]
        assert pod["nodeSelector"] == {"pool": "onlinerl"}, name
        assert pod["imagePullSecrets"] == [{"name": "registry"}], name

    # The fix clears the condition; the Event was posted once for that generation.
    generation = await cluster.patch_spec("demo", {"serving": {"podTemplate": {"metadata": {"labels": None}}}})
    await wait_until(lambda: cluster.status("demo").get("observedGeneration") == generation, what="fixed spec")
    await wait_until(lambda: cluster.condition("demo", "Degraded").get("reason") == "Healthy", what="healthy")
    assert len(events(cluster, "PodTemplateConflict")) == 1


async def test_trainer_template_replaces_the_trainer_and_a_redis_template_does_not(
    cluster: Cluster, empty_valkey
) -> None:
    await cluster.apply_job("demo", spec(empty_valkey.url))
    await wait_until(lambda: cluster.obj("Job", "demo-trainer"), what="trainer Job")
    assert cluster.creations("Job", "demo-trainer") == 1
    serving_hash = cluster.obj("Deployment", "demo-serving")["spec"]["template"]["metadata"]["annotations"]

    gpu = {"spec": {"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]}}
    await cluster.patch_spec("demo", {"trainer": {"podTemplate": gpu}})

    def replaced() -> Any:
        job = cluster.obj("Job", "demo-trainer")
        return job and job["spec"]["template"]["spec"].get("tolerations") and job

    job = await wait_until(replaced, what="trainer Job recreated with the toleration")
    assert job["spec"]["template"]["spec"]["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert cluster.creations("Job", "demo-trainer") == 2
    # serving's pods do not roll for the trainer's template (its config hash leaves pod templates out)
    assert cluster.obj("Deployment", "demo-serving")["spec"]["template"]["metadata"]["annotations"] == serving_hash

    # another component's template does not replace the trainer
    generation = await cluster.patch_spec("demo", {"redis": {"podTemplate": gpu}, "feedback": {"podTemplate": gpu}})
    await wait_until(lambda: cluster.status("demo").get("observedGeneration") == generation, what="third spec")
    feedback = cluster.obj("Deployment", "demo-feedback")["spec"]["template"]["spec"]
    assert feedback["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert cluster.creations("Job", "demo-trainer") == 2


async def test_the_offline_render_is_what_the_operator_applies(cluster: Cluster, empty_valkey) -> None:
    """`render` is not a copy: for the same spec, every object it prints is stored by the running operator with the
    same labels and spec, and the operator stores no other child of the job."""
    job_spec = spec(
        empty_valkey.url,
        trainer={"podTemplate": {"spec": {"priorityClassName": "training"}}},
        ingress={"enabled": True, "host": "code.example.com", "annotations": {"a/b": "c"}},
    )
    body = await cluster.apply_job("demo", job_spec)
    await wait_until(lambda: cluster.obj("Job", "demo-trainer"), what="trainer Job")
    await wait_until(lambda: cluster.status("demo").get("observedGeneration") == 1, what="first pass")
    monitoring = cluster.obj("ServiceMonitor", "demo") is not None
    job = {"apiVersion": c.API_VERSION, "kind": c.KIND, "metadata": body["metadata"], "spec": job_spec}
    apis = frozenset({"monitoring.coreos.com/v1"} if monitoring else set())
    rendered = apply_plan(cli.render_context(job, None, apis, "test"))
    assert {m["metadata"]["namespace"] for m in rendered} == {body["metadata"]["namespace"]}
    for m in rendered:
        stored = cluster.obj(m["kind"], m["metadata"]["name"])
        assert stored is not None, f"{m['kind']} {m['metadata']['name']} rendered but not applied"
        assert stored["metadata"]["labels"] == m["metadata"]["labels"], m["kind"]
        assert stored.get("spec") == m.get("spec"), f"{m['kind']} {m['metadata']['name']}"
    owned = {
        (e.raw["kind"], e.raw["metadata"]["name"])
        for e in cluster.kmock.objects.values()
        if not e.deleted
        and any(o.get("uid") == body["metadata"]["uid"] for o in e.raw.get("metadata", {}).get("ownerReferences", []))
    }
    assert owned == {(m["kind"], m["metadata"]["name"]) for m in rendered}
