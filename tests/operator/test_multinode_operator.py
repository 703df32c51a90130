"""kopf + the real handlers against kmock: the multi-node trainer follows trainer.nodes (Indexed Job + headless
Service, or a JobSet where served), status shows its ranks, and the move between a Job and a JobSet never runs two
trainers at once."""

from __future__ import annotations

from typing import Any

import pytest

from tests.operator.conftest import Cluster, wait_until
from tests.operator.test_reconcile_steps import inject

pytestmark = pytest.mark.timeout(90)

TWO_NODES = {"nodes": 2, "engine": "deepspeed"}


def base_spec(url: str, **sections: Any) -> dict[str, Any]:
    return {"auth": {"allowAnonymous": True}, "redis": {"url": url}, **sections}


def serve_jobset(cluster: Cluster) -> None:
    cluster.kmock.resources["jobset.x-k8s.io/v1alpha2/jobsets"] = cluster.kmock.ResourceInfo(
        kind="JobSet", namespaced=True, verbs={"get", "create", "patch", "delete", "list"}
    )


async def test_nodes_make_an_indexed_job_and_status_shows_the_ranks(cluster: Cluster, empty_valkey) -> None:
    await cluster.apply_job("demo", base_spec(empty_valkey.url, trainer={**TWO_NODES, "gpus": 2}))
    job = await wait_until(lambda: cluster.obj("Job", "demo-trainer"), what="trainer Job")
    assert job["spec"]["completionMode"] == "Indexed" and job["spec"]["completions"] == 2
    svc = await wait_until(lambda: cluster.obj("Service", "demo-trainer-ranks"), what="rendezvous Service")
    assert svc["spec"]["clusterIP"] == "None"
    await wait_until(lambda: cluster.status("demo").get("trainerRanks") == 4, what="ranks in status")
    assert cluster.status("demo")["trainerNodes"] == 2 and cluster.status("demo")["trainerReadyNodes"] == 0
    # Both pods up: the Job controller reports them ready.
    await cluster.make_ready("demo")
    await cluster.set_status("Job", "demo-trainer", {"active": 2, "ready": 2})
    await wait_until(lambda: cluster.status("demo").get("trainerReadyNodes") == 2, what="2 ready nodes")
    await wait_until(lambda: cluster.status("demo").get("phase") == "Running", what="Running")

    # Back to one node: the Job is replaced by a single-pod one and the rendezvous Service goes.
    await cluster.patch_spec("demo", {"trainer": {"nodes": 1, "gpus": 0}})
    await wait_until(
        lambda: (j := cluster.obj("Job", "demo-trainer")) and "completionMode" not in j["spec"], what="one-node Job"
    )
    await wait_until(lambda: cluster.obj("Service", "demo-trainer-ranks") is None, what="rendezvous Service removed")
    await wait_until(lambda: cluster.status("demo").get("trainerRanks") == 1, what="one rank")


async def test_jobset_where_served_and_the_job_goes_first(cluster: Cluster, empty_valkey) -> None:
    """multiNodeApi job -> auto on a cluster serving JobSet: the Indexed Job is deleted before the JobSet exists."""
    serve_jobset(cluster)
    await cluster.apply_job("demo", base_spec(empty_valkey.url, trainer={**TWO_NODES, "multiNodeApi": "job"}))
    await wait_until(lambda: cluster.obj("Job", "demo-trainer"), what="Indexed Job")
    assert cluster.obj("JobSet", "demo-trainer") is None
    await cluster.patch_spec("demo", {"trainer": {**TWO_NODES, "multiNodeApi": "auto"}})
    js = await wait_until(lambda: cluster.obj("JobSet", "demo-trainer"), what="JobSet")
    assert cluster.obj("Job", "demo-trainer") is None  # deleted (foreground) before the JobSet was created
    deletes = [r.id for r in cluster.kmock if r.method.value == "DELETE" and r.resource == "batch/v1/jobs"]
    creates = [
        r.id for r in cluster.kmock if r.method.value == "POST" and r.resource == "jobset.x-k8s.io/v1alpha2/jobsets"
    ]
    assert deletes and creates and max(deletes) < min(creates)
    assert js["spec"]["replicatedJobs"][0]["template"]["spec"]["parallelism"] == 2
    await wait_until(lambda: cluster.obj("Service", "demo-trainer-ranks") is None, what="no own headless Service")
    # JobSet reports ready nodes through its child Job.
    child = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "demo-trainer-node-0", "namespace": "team-a"},
        "spec": js["spec"]["replicatedJobs"][0]["template"]["spec"],
    }
    await cluster.kube.create(child)
    await cluster.set_status("Job", "demo-trainer-node-0", {"active": 2, "ready": 2})
    await cluster.set_status("JobSet", "demo-trainer", {"replicatedJobsStatus": [{"name": "node", "active": 1}]})
    await wait_until(lambda: cluster.status("demo").get("trainerReadyNodes") == 2, what="ready nodes via JobSet")
    await wait_until(lambda: cluster.condition("demo", "TrainerRunning").get("status") == "True", what="running")
    # A failed JobSet is recreated like a failed Job.
    failed = {"conditions": [{"type": "Failed", "status": "True", "reason": "FailedJobs"}]}
    await cluster.set_status("JobSet", "demo-trainer", failed)
    await wait_until(lambda: cluster.status("demo").get("trainerRestarts") == 1, what="JobSet restart counted")


async def test_jobset_asked_for_but_not_served_is_degraded(cluster: Cluster, empty_valkey) -> None:
    await cluster.apply_job("demo", base_spec(empty_valkey.url, trainer={**TWO_NODES, "multiNodeApi": "jobset"}))
    degraded = await wait_until(
        lambda: (d := cluster.condition("demo", "Degraded")).get("status") == "True" and d, what="Degraded"
    )
    assert "trainer.multiNodeApi=jobset but jobset.x-k8s.io/v1alpha2 is not served" in degraded["message"]
    assert "JobSet is not served" in cluster.condition("demo", "TrainerRunning")["message"]
    assert cluster.obj("Job", "demo-trainer") is None  # no silent fallback to another launcher


async def test_a_refused_rendezvous_service_is_a_typed_condition_then_retried(cluster: Cluster, empty_valkey) -> None:
    await cluster.apply_job("demo", base_spec(empty_valkey.url, trainer=TWO_NODES))
    await wait_until(lambda: cluster.obj("Service", "demo-trainer-ranks"), what="rendezvous Service")
    await wait_until(lambda: cluster.condition("demo", "Degraded").get("reason") == "Healthy", what="healthy")
    hit = inject(cluster, "PATCH", "v1/services", "demo-trainer-ranks", 422, times=2)
    await cluster.patch_spec("demo", {"trainer": {**TWO_NODES, "rendezvousPort": 29600}})
    degraded = await wait_until(
        lambda: (d := cluster.condition("demo", "Degraded")).get("reason") == "ApiInvalid" and d,
        what="Degraded/ApiInvalid",
    )
    assert (
        degraded["message"].startswith("children: the API refused the object")
        and "demo-trainer-ranks" in (degraded["message"])
    )
    await wait_until(
        lambda: cluster.obj("Service", "demo-trainer-ranks")["spec"]["ports"][0]["port"] == 29600,
        what="Service updated after the retry",
        timeout=20,
    )
    await wait_until(lambda: cluster.condition("demo", "Degraded").get("reason") == "Healthy", what="recovered")
    assert len(hit) == 2
