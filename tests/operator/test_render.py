"""Rendered manifests: valid Kubernetes (strict, 1.29 and 1.33), owned, and wired per docs/architecture.md."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
import yaml

from onlinerl.config import from_mapping
from onlinerl.vllm_flags import IN_PROCESS_GATEWAY
from onlinerl_operator import constants as c
from onlinerl_operator.render import RenderContext, render_all
from onlinerl_operator.spec import parse_spec
from tests.operator.helpers import example_jobs

UID = "0b5c1a7e-2f62-4a8e-9d1e-3f1f6f3c8a11"
MONITOR_KINDS = {"ServiceMonitor", "PodMonitor"}  # Prometheus-operator CRDs: no built-in schema to validate against


SPECS = {
    **example_jobs(),
    "anon-inline-redis": {
        "auth": {"allowAnonymous": True},
        "redis": {"url": "redis://r:6379/0"},
        "trainer": {"suspend": True},
        "ingress": {"enabled": True},
    },
}


def ctx_for(name: str, monitoring_api: bool = True) -> RenderContext:
    return RenderContext(
        name=name, namespace="team-a", uid=UID, cfg=parse_spec(name, SPECS[name]), monitoring_api=monitoring_api
    )


def by_kind(manifests: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(m["kind"], m["metadata"]["name"]): m for m in manifests}


@pytest.mark.parametrize("k8s", ["1.29", "1.33"])
@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_manifest_validates_strictly(name: str, k8s: str) -> None:
    manifests = render_all(ctx_for(name))
    assert manifests
    for m in manifests:
        if m["kind"] in MONITOR_KINDS:
            continue
        kubernetes_validate.validate(m, k8s, strict=True)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_child_is_owned_and_labelled(name: str) -> None:
    for m in render_all(ctx_for(name)):
        meta = m["metadata"]
        assert meta["namespace"] == "team-a"
        assert meta["ownerReferences"] == [
            {
                "apiVersion": "onlinerl.dev/v1alpha1",
                "kind": "OnlineRLJob",
                "name": name,
                "uid": UID,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ], m["kind"]
        assert meta["labels"][c.LABEL_JOB] == name


def test_cpu_demo_children() -> None:
    ctx = ctx_for("demo", monitoring_api=False)
    objs = by_kind(render_all(ctx))
    assert set(objs) == {
        ("ConfigMap", "demo-config"),
        ("PersistentVolumeClaim", "demo-checkpoints"),
        ("Service", "demo-redis"),
        ("StatefulSet", "demo-redis"),
        ("ConfigMap", "demo-redis-acl"),  # the ACL users and the start script that fills in their hashes
        ("Deployment", "demo-serving"),
        ("Service", "demo-serving"),
        ("Deployment", "demo-feedback"),
        ("Service", "demo-feedback"),
        ("Service", "demo-trainer"),
        ("Job", "demo-trainer"),
        *{("NetworkPolicy", f"demo-{component}") for component in ("serving", "feedback", "trainer", "redis")},
    }
    pod = objs[("Deployment", "demo-serving")]["spec"]["template"]["spec"]
    containers = {ct["name"]: ct for ct in pod["containers"]}
    # serving.gatewayMode auto on the CPU engine image: the gateway runs in the vllm container's process (issue 40)
    assert set(containers) == {"vllm", "reloader"}
    vllm = containers["vllm"]
    assert vllm["args"][vllm["args"].index("--middleware") + 1] == IN_PROCESS_GATEWAY
    assert vllm["image"] == ctx.cfg.images.vllm_cpu
    args = vllm["args"]
    assert args[args.index("--host") + 1] == "127.0.0.1" and args[args.index("--port") + 1] == "8001"
    assert "--enable-lora" in args and "nvidia.com/gpu" not in str(vllm["resources"])
    # vLLM-CPU's worker inside its engine-core process (onlinerl/vllm_flags.py), as the local stack starts it
    assert args[args.index("--distributed-executor-backend") + 1] == "uni"
    assert {"name": "VLLM_ENABLE_V1_MULTIPROCESSING", "value": "0"} in vllm["env"]
    assert [p["containerPort"] for p in vllm["ports"]] == [8000]  # the gateway's; the engine's 8001 is loopback only
    assert containers["reloader"]["command"] == ["python", "-m", "onlinerl_serving.reloader"]
    assert pod["initContainers"][0]["command"][:3] == ["onlinerl", "model", "bootstrap"]
    # Only the gateway port leaves the pod.
    assert objs[("Service", "demo-serving")]["spec"]["ports"] == [
        {"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}
    ]
    assert objs[("Service", "demo-feedback")]["spec"]["ports"][0]["port"] == 8002
    feedback = objs[("Deployment", "demo-feedback")]["spec"]["template"]["spec"]["containers"][0]
    assert feedback["command"] == ["python", "-m", "onlinerl_feedback"]
    job = objs[("Job", "demo-trainer")]
    trainer = job["spec"]["template"]["spec"]["containers"][0]
    assert trainer["command"] == ["python", "-m", "onlinerl_trainer"]
    assert job["spec"]["suspend"] is False and job["spec"]["template"]["spec"]["restartPolicy"] == "Never"
    # Redis durability per docs/architecture.md
    redis_cmd = " ".join(objs[("StatefulSet", "demo-redis")]["spec"]["template"]["spec"]["containers"][0]["command"])
    assert "--appendonly yes" in redis_cmd and "--appendfsync always" in redis_cmd and "noeviction" in redis_cmd
    # Secrets mounted, config passed via ONLINERL_CONFIG
    env = {e["name"]: e.get("value") for e in vllm["env"]}
    assert env["ONLINERL_CONFIG"] == "/etc/onlinerl/onlinerl.yaml"
    assert {"name": "api-keys", "mountPath": "/etc/onlinerl/keys", "readOnly": True} in vllm["volumeMounts"]
    # as its own container when the job asks for it
    spec = {**SPECS["demo"], "serving": {**SPECS["demo"].get("serving", {}), "gatewayMode": "sidecar"}}
    sidecar = RenderContext(name="demo", namespace="team-a", uid=UID, cfg=parse_spec("demo", spec))
    spod = by_kind(render_all(sidecar))[("Deployment", "demo-serving")]["spec"]["template"]["spec"]
    scont = {ct["name"]: ct for ct in spod["containers"]}
    assert set(scont) == {"vllm", "gateway", "reloader"} and "ports" not in scont["vllm"]
    assert scont["gateway"]["command"] == ["python", "-m", "onlinerl_serving.gateway"]


def test_config_map_is_a_loadable_component_config() -> None:
    ctx = ctx_for("demo")
    cm = by_kind(render_all(ctx))[("ConfigMap", "demo-config")]
    cfg = from_mapping(yaml.safe_load(cm["data"]["onlinerl.yaml"]))  # exactly what the components do at start
    assert cfg.job == "demo"
    assert cfg.redis.url == "redis://demo-redis.team-a.svc:6379/0"
    assert cfg.auth.api_keys_file == "/etc/onlinerl/keys/keys.yaml"
    assert cfg.storage.checkpoint_dir == "/checkpoints"
    assert cfg.serving.engine_url == "http://127.0.0.1:8001"
    assert cfg.trainer.batch_size == 8 and cfg.trainer.micro_batch_size == 4  # the spec itself passes through


def test_single_gpu_lora_with_external_redis_and_ingress() -> None:
    ctx = ctx_for("coder")
    objs = by_kind(render_all(ctx))
    assert ("StatefulSet", "coder-redis") not in objs  # external Redis from a Secret
    serving = objs[("Deployment", "coder-serving")]["spec"]["template"]["spec"]
    vllm = serving["containers"][0]
    assert vllm["image"].startswith("vllm/vllm-openai:")
    assert vllm["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert "--tensor-parallel-size" not in vllm["args"]
    assert "--distributed-executor-backend" not in vllm["args"]  # GPUs keep vLLM's own executor choice
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in str(vllm["env"])
    assert vllm["args"][-5:-2] == ["--gpu-memory-utilization", "0.85", "--enable-prefix-caching"]  # spec vllmArgs
    assert vllm["args"][-2:] == ["--logprobs-mode", "processed_logprobs"]  # after them: behaviour log-probs are mu
    gateway_env = {e["name"]: e for e in serving["containers"][1]["env"]}
    assert gateway_env["ONLINERL__REDIS__URL"]["valueFrom"]["secretKeyRef"] == {"name": "coder-redis", "key": "url"}
    assert {"name": "models", "persistentVolumeClaim": {"claimName": "hf-models", "readOnly": True}} in serving[
        "volumes"
    ]
    ing = objs[("Ingress", "coder")]["spec"]
    paths = {p["path"]: p["backend"]["service"] for p in ing["rules"][0]["http"]["paths"]}
    assert paths == {
        "/v1": {"name": "coder-serving", "port": {"number": 8000}},
        "/api/training": {"name": "coder-feedback", "port": {"number": 8002}},
    }
    assert ing["tls"] == [{"hosts": ["coder.example.com"], "secretName": "coder-tls"}]
    assert ing["ingressClassName"] == "nginx"
    trainer = objs[("Job", "coder-trainer")]["spec"]["template"]["spec"]["containers"][0]
    assert trainer["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert trainer["command"] == ["python", "-m", "onlinerl_trainer"]


def test_eight_gpu_full_weight_zero3() -> None:
    ctx = ctx_for("coder-full", monitoring_api=True)
    objs = by_kind(render_all(ctx))
    assert ("PersistentVolumeClaim", "coder-full-checkpoints") not in objs  # existing claim
    job = objs[("Job", "coder-full-trainer")]["spec"]["template"]["spec"]
    trainer = job["containers"][0]
    assert trainer["command"][:3] == ["deepspeed", "--num_gpus", "8"] and trainer["command"][-2:] == [
        "--module",
        "onlinerl_trainer",
    ]
    assert trainer["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "coder-checkpoints"}} in job["volumes"]
    assert job["initContainers"][0]["image"] == "registry.example.com/models/qwen2.5-coder-7b:1"
    vllm = objs[("Deployment", "coder-full-serving")]["spec"]["template"]["spec"]["containers"][0]
    assert vllm["args"][vllm["args"].index("--tensor-parallel-size") + 1] == "2"
    assert "--enable-lora" not in vllm["args"]
    assert {"name": "VLLM_SERVER_DEV_MODE", "value": "1"} in vllm["env"]
    assert ("ServiceMonitor", "coder-full") in objs and ("PodMonitor", "coder-full-reloader") in objs


def test_monitors_follow_the_api_in_auto_mode() -> None:
    assert not any(m["kind"] in MONITOR_KINDS for m in render_all(ctx_for("demo", monitoring_api=False)))
    assert {m["kind"] for m in render_all(ctx_for("demo", monitoring_api=True))} >= MONITOR_KINDS


def test_rendering_is_deterministic_and_config_changes_roll_the_pods() -> None:
    a, b = render_all(ctx_for("demo")), render_all(ctx_for("demo"))
    assert a == b
    changed = RenderContext(
        name="demo",
        namespace="team-a",
        uid=UID,
        cfg=parse_spec("demo", {**SPECS["demo"], "feedback": {"replicas": 1, "maxBacklog": 10}}),
    )
    key = "onlinerl.dev/config-hash"

    def pod_hash(manifests: list[dict[str, Any]]) -> str:
        return by_kind(manifests)[("Deployment", "demo-serving")]["spec"]["template"]["metadata"]["annotations"][key]

    old, new = pod_hash(a), pod_hash(render_all(changed))
    assert old != new
    # Suspending the trainer or pinning a version must not restart serving (both act at runtime).
    pinned = {"rollout": {**SPECS["demo"].get("rollout", {}), "pinnedVersion": 2}}  # the rest of the section kept
    for runtime_only in ({"trainer": {**SPECS["demo"]["trainer"], "suspend": True}}, pinned):
        same = RenderContext(
            name="demo", namespace="team-a", uid=UID, cfg=parse_spec("demo", {**SPECS["demo"], **runtime_only})
        )
        pod = by_kind(render_all(same))[("Deployment", "demo-serving")]["spec"]["template"]
        assert pod["metadata"]["annotations"][key] == old, runtime_only


def test_rbac_allows_exactly_what_the_operator_does() -> None:
    """operator/rbac.yaml (mirrored by the helm chart) covers every child kind with the verbs kube.py uses."""
    from onlinerl_operator.kube import KINDS
    from tests.operator.helpers import ROOT

    rules = yaml.safe_load((ROOT / "operator" / "rbac.yaml").read_text())["rules"]

    def allowed(group: str, resource: str) -> set[str]:
        return {v for r in rules if group in r["apiGroups"] and resource in r["resources"] for v in r["verbs"]}

    kinds = {m["kind"] for name in SPECS for m in render_all(ctx_for(name))}
    for kind in kinds - {"Secret"}:
        prefix, plural = KINDS[kind]
        group = "" if prefix == "/api/v1" else prefix.split("/")[2]
        assert allowed(group, plural) >= {"get", "create", "patch", "delete"}, kind
        assert not allowed(group, plural) & {"list", "watch", "*"}, f"{kind}: more than needed"
    assert allowed("", "secrets") == {"get", "create"}  # the Redis password Secret: created once, never patched
    assert allowed("onlinerl.dev", "onlinerljobs/status") >= {"patch"}


def test_rollout_controller_only_with_canary_strategy() -> None:
    """canary: the eval-gate/canary controller runs as its own Deployment (+ metrics Service); direct: it does not."""
    canary = next(n for n, s in SPECS.items() if (s.get("rollout") or {}).get("strategy") == "canary")
    ctx = ctx_for(canary)
    objs = by_kind(render_all(ctx))
    dep = objs[("Deployment", f"{canary}-rollout")]
    pod = dep["spec"]["template"]["spec"]
    main = pod["containers"][0]
    assert main["command"] == ["python", "-m", "onlinerl_rollout"] and dep["spec"]["replicas"] == 1
    env = {e["name"]: e.get("value") for e in main["env"]}
    assert env["ONLINERL_ROLLOUT_EVALUATOR"] == c.GATE_EVALUATOR
    assert env["ONLINERL_GATEWAY_URL"] == f"http://{canary}-serving:{ctx.cfg.serving.port}"
    assert env["ONLINERL_EVAL_DATA"].startswith(c.EVAL_DATA_DIR)
    assert pod["initContainers"][0]["command"][:3] == ["onlinerl", "data", "build"]
    svc = objs[("Service", f"{canary}-rollout")]
    assert svc["spec"]["ports"][0]["name"] == "metrics" and svc["metadata"]["labels"]["onlinerl.dev/metrics"] == "true"
    assert dep["metadata"]["ownerReferences"][0]["uid"] == UID
    direct = next(n for n, s in SPECS.items() if (s.get("rollout") or {}).get("strategy", "direct") == "direct")
    assert not [m for m in render_all(ctx_for(direct)) if m["metadata"]["name"].endswith("-rollout")]
