"""The multi-node trainer as rendered (2 nodes x 4 GPUs): an Indexed Job + headless Service, or a JobSet where the
cluster serves it; valid Kubernetes (strict, 1.29 and 1.33), torchrun's static rendezvous at pod 0's stable name."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest

from onlinerl_operator.render import RenderContext, render_all
from onlinerl_operator.render_trainer import JOBSET_API, torchrun_command, trainer_workload, world_size
from onlinerl_operator.spec import SpecError, parse_spec

UID = "0b5c1a7e-2f62-4a8e-9d1e-3f1f6f3c8a11"
K8S = ("1.29", "1.33")
GPU = {"auth": {"allowAnonymous": True}, "trainer": {"nodes": 2, "gpus": 4, "engine": "deepspeed", "zeroStage": 3}}
CPU = {"auth": {"allowAnonymous": True}, "trainer": {"nodes": 2, "engine": "deepspeed"}}


def ctx(spec: dict[str, Any], apis: frozenset[str] = frozenset()) -> RenderContext:
    return RenderContext(name="demo", namespace="team-a", uid=UID, cfg=parse_spec("demo", spec), apis=apis)


def objs(c: RenderContext) -> dict[tuple[str, str], dict[str, Any]]:
    return {(m["kind"], m["metadata"]["name"]): m for m in render_all(c)}


def as_job(job_spec: dict[str, Any]) -> dict[str, Any]:
    """A JobSet's replicated Job template as a batch/v1 Job, so kubernetes-validate checks it (JobSet is a CRD)."""
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "demo-trainer-node-0"}, "spec": job_spec}


@pytest.mark.parametrize("jobset", [False, True], ids=["indexed-job", "jobset"])
def test_every_multinode_manifest_validates_strictly(jobset: bool) -> None:
    manifests = render_all(ctx(GPU, frozenset({JOBSET_API}) if jobset else frozenset()))
    for m in manifests:
        if m["kind"] in ("ServiceMonitor", "PodMonitor"):
            continue
        target = as_job(m["spec"]["replicatedJobs"][0]["template"]["spec"]) if m["kind"] == "JobSet" else m
        for version in K8S:
            kubernetes_validate.validate(target, version, strict=True)
    assert {m["kind"] for m in manifests if m["metadata"]["name"] == "demo-trainer"} == {
        "Service",
        "NetworkPolicy",
        "JobSet" if jobset else "Job",
    }


def test_indexed_job_and_headless_service() -> None:
    found = objs(ctx(GPU))
    job = found[("Job", "demo-trainer")]["spec"]
    assert (job["completionMode"], job["completions"], job["parallelism"]) == ("Indexed", 2, 2)
    pod = job["template"]["spec"]
    assert pod["subdomain"] == "demo-trainer-ranks" and pod["restartPolicy"] == "Never"
    (container,) = pod["containers"]
    assert container["command"] == [
        "torchrun",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "4",
        "--node-rank",
        "$(NODE_RANK)",
        "--master-addr",
        "demo-trainer-0.demo-trainer-ranks.team-a.svc",
        "--master-port",
        "29500",
        "-m",
        "onlinerl_trainer",
    ]
    # The node rank is the completion index; the kubelet expands $(NODE_RANK) because it is defined first.
    assert container["env"][0] == {
        "name": "NODE_RANK",
        "valueFrom": {"fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}},
    }
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "4"
    assert {"name": "rendezvous", "containerPort": 29500, "protocol": "TCP"} in container["ports"]
    # Followers have no metrics port: only node 0 is probed.
    probe = container["livenessProbe"]["exec"]["command"][2]
    assert probe.startswith('[ "$NODE_RANK" != 0 ] ||') and ":8003/healthz" in probe
    ranks = found[("Service", "demo-trainer-ranks")]["spec"]
    assert ranks["clusterIP"] == "None" and ranks["publishNotReadyAddresses"] is True
    assert ranks["selector"] == {"onlinerl.dev/job": "demo", "onlinerl.dev/component": "trainer"}
    metrics = found[("Service", "demo-trainer")]["spec"]
    assert metrics["selector"]["batch.kubernetes.io/job-completion-index"] == "0"
    # The trainer's NetworkPolicy admits its own pods on every port (rendezvous, gloo/NCCL), others on metrics only.
    rules = found[("NetworkPolicy", "demo-trainer")]["spec"]["ingress"]
    assert rules[0] == {"ports": [{"protocol": "TCP", "port": 8003}]}
    assert rules[1] == {
        "from": [{"podSelector": {"matchLabels": {"onlinerl.dev/job": "demo", "onlinerl.dev/component": "trainer"}}}]
    }
    assert world_size(ctx(GPU)) == 8 and world_size(ctx(CPU)) == 2


def test_jobset_where_served() -> None:
    c = ctx(GPU, frozenset({JOBSET_API}))
    found = objs(c)
    assert ("Job", "demo-trainer") not in found and ("Service", "demo-trainer-ranks") not in found  # JobSet makes it
    js = found[("JobSet", "demo-trainer")]
    assert js["apiVersion"] == "jobset.x-k8s.io/v1alpha2" and js["metadata"]["ownerReferences"][0]["uid"] == UID
    assert js["spec"]["network"]["subdomain"] == "demo-trainer-ranks"  # not the metrics Service's name
    assert js["spec"]["failurePolicy"] == {"maxRestarts": 2}
    (rjob,) = js["spec"]["replicatedJobs"]
    assert rjob["name"] == "node" and rjob["replicas"] == 1
    assert rjob["template"]["spec"]["completions"] == 2 and rjob["template"]["spec"]["backoffLimit"] == 0
    assert "subdomain" not in rjob["template"]["spec"]["template"]["spec"]
    cmd = torchrun_command(c)
    assert cmd[cmd.index("--master-addr") + 1] == "demo-trainer-node-0-0.demo-trainer-ranks.team-a.svc"
    # multiNodeApi: job keeps the Indexed Job even where JobSet is served.
    forced = {**GPU, "trainer": {**GPU["trainer"], "multiNodeApi": "job"}}
    assert trainer_workload(ctx(forced, frozenset({JOBSET_API})))["kind"] == "Job"


def test_one_node_is_unchanged() -> None:
    """nodes: 1 (the default): the single-pod Job, no rendezvous Service, metrics Service on the pod as before."""
    found = objs(ctx({"auth": {"allowAnonymous": True}}))
    job = found[("Job", "demo-trainer")]["spec"]
    assert "completionMode" not in job and job["template"]["spec"]["containers"][0]["command"][0] == "python"
    assert ("Service", "demo-trainer-ranks") not in found
    assert "batch.kubernetes.io/job-completion-index" not in found[("Service", "demo-trainer")]["spec"]["selector"]


@pytest.mark.parametrize(
    ("trainer", "message"),
    [
        ({"nodes": 2}, "trainer.nodes above 1 runs several ranks: set trainer.engine: deepspeed"),
        ({"nodes": 2, "engine": "torch"}, "trainer.nodes above 1 runs several ranks"),
        ({"nodes": 0}, "trainer.nodes"),
        ({"nodes": 1000, "engine": "deepspeed"}, "trainer.nodes"),
        ({"nodes": 2, "engine": "deepspeed", "rendezvousPort": 70000}, "trainer.rendezvousPort"),
        ({"nodes": 2, "engine": "deepspeed", "multiNodeApi": "mpi"}, "trainer.multiNodeApi"),
    ],
)
def test_bad_multinode_specs_are_refused_naming_the_field(trainer: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_spec("demo", {"auth": {"allowAnonymous": True}, "trainer": trainer})
    assert message in str(err.value)
