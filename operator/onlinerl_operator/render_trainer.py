"""Pure rendering of a multi-node trainer (``trainer.nodes > 1``) on machinery Kubernetes already has.

One pod per node, each running ``torchrun`` with a static rendezvous at pod 0:

- an **Indexed Job** (``completionMode: Indexed``, ``completions = parallelism = nodes``) plus a headless Service
  (``subdomain``) that gives pod 0 the stable name ``<job>-trainer-0.<job>-trainer-ranks``; or
- a **JobSet** (jobset.x-k8s.io/v1alpha2, where the cluster serves it): one replicated Job of the same shape; JobSet
  makes the headless Service itself and restarts every node together when one fails.

The node rank is the pod's completion index, read through the downward API (the annotation every Indexed Job pod
carries), so one pod template serves every node. torchrun sets ``RANK``/``WORLD_SIZE`` for each process, which is what
``onlinerl_trainer.ranks.ranks_from_env`` reads: global rank 0 (node 0, local rank 0) is the only stream reader and the
only process with the metrics port, so the probes and the metrics Service look at node 0 only.
"""

from __future__ import annotations

import copy
from typing import Any

from onlinerl_operator import constants as c
from onlinerl_operator.render import Manifest, RenderContext, metadata, selector, service, trainer_hash, trainer_job
from onlinerl_operator.render_pod_template import customise

JOBSET_API = "jobset.x-k8s.io/v1alpha2"
COMPLETION_INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
COMPLETION_INDEX_LABEL = "batch.kubernetes.io/job-completion-index"  # on pods since Kubernetes 1.28
NODE_RANK_ENV = "NODE_RANK"
REPLICATED_JOB = "node"


def multi_node(ctx: RenderContext) -> bool:
    return ctx.cfg.trainer.nodes > 1


def uses_jobset(ctx: RenderContext) -> bool:
    """JobSet when asked for, or on ``auto`` when the cluster serves jobset.x-k8s.io/v1alpha2."""
    api = ctx.cfg.trainer.multi_node_api
    return multi_node(ctx) and (api == "jobset" or (api == "auto" and JOBSET_API in ctx.apis))


def procs_per_node(ctx: RenderContext) -> int:
    return max(ctx.cfg.trainer.gpus, 1)


def world_size(ctx: RenderContext) -> int:
    """Ranks in the whole trainer: nodes x processes per node (1 for a single CPU process)."""
    return ctx.cfg.trainer.nodes * procs_per_node(ctx)


def rendezvous_service_name(ctx: RenderContext) -> str:
    """The headless Service pods resolve each other through (the JobSet's ``network.subdomain``: JobSet's default,
    the JobSet's own name, is taken by the trainer's metrics Service)."""
    return ctx.child("trainer-ranks")


def master_host(ctx: RenderContext) -> str:
    """Pod 0's stable DNS name: ``<hostname>.<subdomain>.<namespace>.svc``."""
    # JobSet: <jobset>-<replicatedJob>-<job index>-<pod index>; Indexed Job: <job>-<completion index>.
    pod0 = f"{ctx.child('trainer')}-{REPLICATED_JOB}-0-0" if uses_jobset(ctx) else f"{ctx.child('trainer')}-0"
    return f"{pod0}.{rendezvous_service_name(ctx)}.{ctx.namespace}.svc"


def torchrun_command(ctx: RenderContext) -> list[str]:
    """torchrun with a static rendezvous at pod 0; ``$(NODE_RANK)`` is expanded by the kubelet from the env."""
    t = ctx.cfg.trainer
    return [
        "torchrun",
        "--nnodes",
        str(t.nodes),
        "--nproc-per-node",
        str(procs_per_node(ctx)),
        "--node-rank",
        f"$({NODE_RANK_ENV})",
        "--master-addr",
        master_host(ctx),
        "--master-port",
        str(t.rendezvous_port),
        "-m",
        "onlinerl_trainer",
    ]


def _leader_probe(ctx: RenderContext, period: int, failures: int) -> dict[str, Any]:
    """Only node 0 serves ``/healthz`` (its rank 0 holds the metrics port); other nodes pass the probe."""
    port = ctx.cfg.trainer.metrics_port
    check = (
        f'[ "${NODE_RANK_ENV}" != 0 ] || python3 -c "import urllib.request; '
        f"urllib.request.urlopen('http://127.0.0.1:{port}/healthz', timeout=4)\""
    )
    return {
        "exec": {"command": ["sh", "-c", check]},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": 5,
    }


def node_pod_template(ctx: RenderContext) -> dict[str, Any]:
    """The single-node trainer's pod template, turned into one node of the multi-node trainer."""
    template = copy.deepcopy(trainer_job(ctx)["spec"]["template"])
    pod = template["spec"]
    container = pod["containers"][0]
    container["command"] = torchrun_command(ctx)
    container["env"] = [
        {
            "name": NODE_RANK_ENV,
            "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{COMPLETION_INDEX_ANNOTATION}']"}},
        },
        *container["env"],
    ]
    container["ports"].append(
        {"name": "rendezvous", "containerPort": ctx.cfg.trainer.rendezvous_port, "protocol": "TCP"}
    )
    container["startupProbe"] = _leader_probe(ctx, period=10, failures=60)
    container["livenessProbe"] = _leader_probe(ctx, period=15, failures=4)
    if not uses_jobset(ctx):
        pod["subdomain"] = rendezvous_service_name(ctx)  # JobSet sets hostname and subdomain itself
    return template


def _indexed_job_spec(ctx: RenderContext) -> dict[str, Any]:
    nodes = ctx.cfg.trainer.nodes
    return {
        "completionMode": "Indexed",
        "completions": nodes,
        "parallelism": nodes,
        "backoffLimit": 2 * nodes,
        "template": node_pod_template(ctx),
    }


def indexed_job(ctx: RenderContext) -> Manifest:
    meta = metadata(ctx, ctx.child("trainer"), "trainer")
    meta["annotations"] = {c.ANNO_SPEC_HASH: trainer_hash(ctx)}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": meta,
        "spec": {"suspend": ctx.cfg.trainer.suspend, **_indexed_job_spec(ctx)},
    }


def jobset(ctx: RenderContext) -> Manifest:
    """The JobSet form: any failed node restarts all of them together (``failurePolicy.maxRestarts``)."""
    meta = metadata(ctx, ctx.child("trainer"), "trainer")
    meta["annotations"] = {c.ANNO_SPEC_HASH: trainer_hash(ctx)}
    job_spec = _indexed_job_spec(ctx)
    job_spec["backoffLimit"] = 0  # JobSet restarts the whole set; a lone retried pod could not rejoin
    return {
        "apiVersion": JOBSET_API,
        "kind": "JobSet",
        "metadata": meta,
        "spec": {
            "suspend": ctx.cfg.trainer.suspend,
            "network": {
                "enableDNSHostnames": True,
                "subdomain": rendezvous_service_name(ctx),
                "publishNotReadyAddresses": True,
            },
            "failurePolicy": {"maxRestarts": 2},
            "replicatedJobs": [{"name": REPLICATED_JOB, "replicas": 1, "template": {"spec": job_spec}}],
        },
    }


def operator_trainer_workload(ctx: RenderContext) -> Manifest:
    """What runs the trainer, as the operator renders it: the single-pod Job, the Indexed Job or the JobSet."""
    if not multi_node(ctx):
        return trainer_job(ctx)
    return jobset(ctx) if uses_jobset(ctx) else indexed_job(ctx)


def trainer_workload(ctx: RenderContext) -> Manifest:
    """What runs the trainer, as applied: with the trainer's pod-template fragment merged in."""
    return customise(ctx.cfg, "trainer", operator_trainer_workload(ctx))[0]


def rendezvous_service(ctx: RenderContext) -> Manifest | None:
    """Headless Service of the Indexed Job's pods: DNS names before they are ready, so rendezvous can start."""
    if not multi_node(ctx) or uses_jobset(ctx):
        return None
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(ctx, rendezvous_service_name(ctx), "trainer"),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": selector(ctx, "trainer"),
            "ports": [
                {
                    "name": "rendezvous",
                    "port": ctx.cfg.trainer.rendezvous_port,
                    "targetPort": "rendezvous",
                    "protocol": "TCP",
                }
            ],
        },
    }


def metrics_service(ctx: RenderContext) -> Manifest:
    """The trainer's metrics Service; with several nodes it selects node 0 only (followers have no metrics port)."""
    svc = service(ctx, "trainer", "metrics", ctx.cfg.trainer.metrics_port)
    if multi_node(ctx):
        svc["spec"]["selector"] = {**svc["spec"]["selector"], COMPLETION_INDEX_LABEL: "0"}
    return svc


def peer_ingress_rule(ctx: RenderContext) -> dict[str, Any] | None:
    """The trainer's NetworkPolicy also admits its own pods on every port: the rendezvous store and the collectives'
    (gloo/NCCL) connections use ports chosen at run time."""
    if not multi_node(ctx):
        return None
    return {"from": [{"podSelector": {"matchLabels": selector(ctx, "trainer")}}]}


def shape_trainer_policy(ctx: RenderContext, policy: Manifest) -> Manifest:
    rule = peer_ingress_rule(ctx)
    if rule is not None:
        policy["spec"]["ingress"].append(rule)
    return policy


def trainer_problems(ctx: RenderContext) -> list[str]:
    """An asked-for JobSet API the cluster does not serve (the trainer is not created, the job shows Degraded)."""
    if uses_jobset(ctx) and JOBSET_API not in ctx.apis:
        return [f"trainer.multiNodeApi=jobset but {JOBSET_API} is not served (install JobSet or use auto)"]
    return []
