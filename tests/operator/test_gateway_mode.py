"""The serving pod in both ``serving.gatewayMode``s (issue 40): ``sidecar``, the gateway a container of its own, and
``inProcess``, the gateway inside the vllm container's process (vLLM's ``--middleware``), no container of its own.

Rendered (pure) and through the real operator on kmock. In both modes what reaches the gateway finds it: the
Service's target port, the NetworkPolicy, the monitors' ports and the autoscaler's metric, all by the pod's ``http``
port. In ``inProcess`` the vllm container carries everything the gateway container had that its code reads (env with
its own Redis user, config and keys mounts, port, probes), and vLLM itself still listens on loopback only.
"""

from __future__ import annotations

import copy
from typing import Any

import kubernetes_validate
import pytest
import yaml

from onlinerl.config import from_mapping
from onlinerl.config_rules import ENGINE_GPU_IMAGE
from onlinerl.vllm_flags import BEHAVIOUR_LOGPROBS_ARGS, IN_PROCESS_GATEWAY, gateway_args, gateway_mode
from onlinerl_operator import constants as c
from onlinerl_operator import render_scaling
from onlinerl_operator.render import (
    REDIS_PASSWORD_ENV,
    RenderContext,
    pod_template_problems,
    render_all,
)
from onlinerl_operator.spec import SpecError, parse_spec
from tests.operator.conftest import Cluster, wait_until
from tests.operator.helpers import example_jobs

UID = "5d1f0c2e-0a1b-4c3d-8e9f-112233445566"
EXAMPLES = example_jobs()
MIDDLEWARE = ["--middleware", IN_PROCESS_GATEWAY]


def with_mode(spec: dict[str, Any], mode: str, **serving: Any) -> dict[str, Any]:
    out = copy.deepcopy(spec)
    out["serving"] = {**out.get("serving", {}), "gatewayMode": mode, **serving}
    return out


def render(name: str, spec: dict[str, Any], **ctx: Any) -> dict[tuple[str, str], dict[str, Any]]:
    rc = RenderContext(name=name, namespace="team-a", uid=UID, cfg=parse_spec(name, spec), **ctx)
    return {(m["kind"], m["metadata"]["name"]): m for m in render_all(rc)}


def serving_pod(objs: dict[tuple[str, str], dict[str, Any]], name: str) -> dict[str, Any]:
    return objs[("Deployment", f"{name}-serving")]["spec"]["template"]["spec"]


def containers(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {ct["name"]: ct for ct in pod["containers"]}


def named_port(pod: dict[str, Any], name: str) -> tuple[str, int]:
    """(container, port number) a named port resolves to in the pod, as the kubelet resolves a targetPort."""
    found = [
        (ct["name"], p["containerPort"]) for ct in pod["containers"] for p in ct.get("ports", []) if p["name"] == name
    ]
    assert len(found) == 1, found
    return found[0]


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container["env"]}


# --- rendering ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "serving, images, expected",
    [
        ({}, {}, "inProcess"),  # CPU: our engine image carries the serving package
        ({"gpus": 1}, {}, "sidecar"),  # upstream vLLM's GPU image cannot load it
        ({"gpus": 1}, {"vllm": "docker.io/vllm/vllm-openai@sha256:" + "0" * 64}, "sidecar"),
        ({"gpus": 1}, {"vllm": ENGINE_GPU_IMAGE}, "inProcess"),  # our GPU engine image can
        ({"gatewayMode": "sidecar"}, {}, "sidecar"),  # what a job says wins
        ({"gatewayMode": "inProcess", "gpus": 1}, {"vllm": ENGINE_GPU_IMAGE}, "inProcess"),
    ],
)
def test_auto_runs_the_gateway_in_vllms_process_wherever_the_engine_image_can_load_it(
    serving: dict[str, Any], images: dict[str, Any], expected: str
) -> None:
    cfg = from_mapping({"serving": serving, "images": images})
    assert gateway_mode(cfg) == expected
    assert (MIDDLEWARE[0] in gateway_args(gateway_mode(cfg))) == (expected == "inProcess")


@pytest.mark.parametrize(("mode", "gateway_in"), [("sidecar", "gateway"), ("inProcess", "vllm")])
def test_everything_that_reaches_the_gateway_finds_it_in_both_modes(mode: str, gateway_in: str) -> None:
    """Service targetPort, NetworkPolicy, ServiceMonitor and PodMonitor (port ``http``) resolve to the container
    that runs the gateway, on serving.port (9100 here, not the default); vLLM's port is exposed by none."""
    objs = render("demo", with_mode(EXAMPLES["demo"], mode, port=9100), monitoring_api=True)
    pod = serving_pod(objs, "demo")
    names = [ct["name"] for ct in pod["containers"]]
    assert names == (["vllm", "gateway", "reloader"] if mode == "sidecar" else ["vllm", "reloader"])
    [port] = objs[("Service", "demo-serving")]["spec"]["ports"]
    assert port["port"] == 9100 and named_port(pod, port["targetPort"]) == (gateway_in, 9100)
    policy = objs[("NetworkPolicy", "demo-serving")]["spec"]["ingress"][0]["ports"]
    assert {p["port"] for p in policy} == {9100, c.RELOADER_PORT}  # never vLLM's 8001
    assert all(p["containerPort"] != c.ENGINE_PORT for ct in pod["containers"] for p in ct.get("ports", []))
    for endpoint in objs[("PodMonitor", "demo-reloader")]["spec"]["podMetricsEndpoints"]:
        named_port(pod, endpoint["port"])  # /engine/metrics on http, the reloader's own on reloader
    assert named_port(pod, "http") == (gateway_in, 9100)
    assert "http" in {e["port"] for e in objs[("ServiceMonitor", "demo")]["spec"]["endpoints"]}
    # the gateway reads its port from the ConfigMap, in its own process or in vLLM's
    config = from_mapping(yaml.safe_load(objs[("ConfigMap", "demo-config")]["data"][c.CONFIG_FILE]))
    assert (config.serving.port, config.serving.gateway_mode) == (9100, mode)
    assert config.serving.engine_url == f"http://127.0.0.1:{c.ENGINE_PORT}"
    for manifest in objs.values():
        if manifest["kind"] not in ("ServiceMonitor", "PodMonitor"):
            kubernetes_validate.validate(manifest, "1.33", strict=True)


def test_in_process_the_vllm_container_carries_the_gateway() -> None:
    """inProcess on CPU: the middleware flag (after the LoRA flags, before serving.vllmArgs; the behaviour log-prob
    flags still last), the gateway's env merged with vLLM's (each name once; its own Redis user, the password before
    the URL that references it), the config and keys mounts, the gateway's probes on http with vLLM's startup probe
    kept, vLLM still on 127.0.0.1:8001, no privilege escalation. The sidecar's vllm container has none of it."""
    spec = with_mode(EXAMPLES["demo"], "inProcess", vllmArgs=["--max-num-seqs", "8"])
    pod = serving_pod(render("demo", spec), "demo")
    vllm = containers(pod)["vllm"]
    args = vllm["args"]
    assert vllm["image"] == from_mapping({}).images.vllm_cpu
    assert vllm["command"] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    at = args.index("--middleware")
    assert args[at : at + 2] == MIDDLEWARE and args.count("--middleware") == 1
    assert args.index("--enable-lora") < at < args.index("--max-num-seqs")
    assert args[-2:] == list(BEHAVIOUR_LOGPROBS_ARGS)
    assert args[args.index("--host") + 1] == "127.0.0.1" and args[args.index("--port") + 1] == str(c.ENGINE_PORT)

    names = [e["name"] for e in vllm["env"]]
    assert len(names) == len(set(names)), names
    env = env_of(vllm)
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"]["value"] == "True"  # vLLM's own stay
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"]["value"] == "0"
    assert env["ONLINERL_CONFIG"]["value"] == f"{c.CONFIG_DIR}/{c.CONFIG_FILE}"
    assert env[REDIS_PASSWORD_ENV]["valueFrom"]["secretKeyRef"] == {"name": "demo-redis-users", "key": "gateway"}
    assert names.index(REDIS_PASSWORD_ENV) < names.index("ONLINERL__REDIS__URL")  # $(VAR) needs it first
    assert env["ONLINERL__REDIS__URL"]["value"].startswith(f"redis://gateway:$({REDIS_PASSWORD_ENV})@demo-redis.")

    mounts = {m["name"]: m for m in vllm["volumeMounts"]}
    assert mounts["config"] == {"name": "config", "mountPath": c.CONFIG_DIR, "readOnly": True}
    assert mounts["api-keys"] == {"name": "api-keys", "mountPath": c.KEYS_DIR, "readOnly": True}
    assert {"checkpoints", "dshm", "model-copy"} <= set(mounts)
    volumes = {v["name"] for v in pod["volumes"]}
    assert set(mounts) <= volumes

    assert vllm["ports"] == [{"name": "http", "containerPort": c.GATEWAY_PORT, "protocol": "TCP"}]
    assert vllm["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert vllm["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    startup = vllm["startupProbe"]
    assert (
        startup["exec"]["command"][:2] == ["python3", "-c"]
        and f":{c.ENGINE_PORT}/health" in startup["exec"]["command"][2]
    )
    assert startup["failureThreshold"] * startup["periodSeconds"] >= 1800  # vLLM's long load, then the gateway
    assert vllm["securityContext"] == {"allowPrivilegeEscalation": False}

    # The reloader is untouched: its own user, and it still finds vLLM and the gateway on loopback (the ConfigMap).
    reloader = containers(pod)["reloader"]
    assert env_of(reloader)[REDIS_PASSWORD_ENV]["valueFrom"]["secretKeyRef"]["key"] == "reloader"

    sidecar = containers(serving_pod(render("demo", with_mode(EXAMPLES["demo"], "sidecar")), "demo"))
    assert "--middleware" not in sidecar["vllm"]["args"] and "ports" not in sidecar["vllm"]
    assert "ONLINERL_CONFIG" not in env_of(sidecar["vllm"]) and "readinessProbe" not in sidecar["vllm"]
    assert "exec" in sidecar["vllm"]["livenessProbe"]  # vLLM's own health, as before
    gateway = sidecar["gateway"]
    assert gateway["readinessProbe"] == vllm["readinessProbe"] and gateway["livenessProbe"] == vllm["livenessProbe"]
    assert env_of(gateway).items() <= env.items()  # everything the gateway container had, vLLM's now has


def test_in_process_on_gpus_with_the_engine_gpu_image_and_an_external_redis() -> None:
    """The GPU example (Redis URL from a Secret) in inProcess with images.vllm = the engine-gpu image: that image,
    the GPUs, the middleware, the gateway's Redis URL from the Secret, no CPU-only flags or env."""
    spec = with_mode(EXAMPLES["coder"], "inProcess")
    spec["images"] = {**spec.get("images", {}), "vllm": ENGINE_GPU_IMAGE}
    pod = serving_pod(render("coder", spec), "coder")
    assert [ct["name"] for ct in pod["containers"]] == ["vllm", "reloader"]
    vllm = pod["containers"][0]
    assert vllm["image"] == ENGINE_GPU_IMAGE and vllm["resources"]["limits"]["nvidia.com/gpu"] == "1"
    args = vllm["args"]
    assert args[args.index("--middleware") + 1] == IN_PROCESS_GATEWAY
    assert args[-5:] == ["--gpu-memory-utilization", "0.85", "--enable-prefix-caching", *BEHAVIOUR_LOGPROBS_ARGS]
    assert "--distributed-executor-backend" not in args and "VLLM_ENABLE_V1_MULTIPROCESSING" not in env_of(vllm)
    assert env_of(vllm)["ONLINERL__REDIS__URL"]["valueFrom"]["secretKeyRef"] == {"name": "coder-redis", "key": "url"}
    assert named_port(pod, "http") == ("vllm", c.GATEWAY_PORT)


def test_in_process_on_gpus_with_upstream_vllm_is_refused_by_the_operator() -> None:
    """Upstream vllm/vllm-openai cannot import the gateway: the operator refuses the spec with the rule's message
    (onlinerl/config_rules.py; tests/foundation/test_config_rules.py covers the CRD and the CLI)."""
    with pytest.raises(SpecError) as err:
        parse_spec("coder", with_mode(EXAMPLES["coder"], "inProcess"))
    message = str(err.value)
    assert "serving.gatewayMode: inProcess runs the gateway inside vLLM's process" in message
    assert f"set images.vllm to it, e.g. {ENGINE_GPU_IMAGE}, or set serving.gatewayMode: sidecar" in message
    assert "images.vllm='vllm/vllm-openai:v0.32.0'" in message


def _autoscaled(provider: str) -> dict[str, Any]:
    """The demo with its serving autoscaled on the gateway's in-flight requests (KEDA through Prometheus, or an HPA
    Pods metric through prometheus-adapter)."""
    autoscale = {"enabled": True, "maxReplicas": 3, "metric": "load", "provider": provider}
    scaling = {"prometheusUrl": "http://prometheus.monitoring:9090", "serving": {"autoscale": autoscale}}
    return {**EXAMPLES["demo"], "scaling": scaling}


SCALED = {"demo-keda": _autoscaled("keda"), "demo-hpa": _autoscaled("hpa")}


@pytest.mark.parametrize("example", sorted(EXAMPLES) + sorted(SCALED))
def test_only_the_serving_pod_changes_with_the_mode(example: str) -> None:
    """Switching the mode changes the serving Deployment (a new config hash rolls its pods) and the ConfigMap, and
    nothing else: Services, policies, monitors, autoscalers (their metric is the gateway's, scraped on ``http``) and
    budgets read the same in both modes."""
    spec = {**EXAMPLES, **SCALED}[example]
    inproc = with_mode(spec, "inProcess")
    if spec.get("serving", {}).get("gpus", 0) > 0:
        inproc["images"] = {**inproc.get("images", {}), "vllm": ENGINE_GPU_IMAGE}
    sidecar = with_mode(spec, "sidecar")
    if "images" in inproc:
        sidecar["images"] = inproc["images"]
    apis = frozenset({render_scaling.KEDA_API, render_scaling.CUSTOM_METRICS_API})
    a = render(example, sidecar, monitoring_api=True, apis=apis)
    b = render(example, inproc, monitoring_api=True, apis=apis)
    assert set(a) == set(b)
    if example in SCALED:  # not vacuous: the autoscaler is there, on the gateway's metric
        scaler = (
            a[("ScaledObject", f"{example}-serving")]
            if example.endswith("keda")
            else a[("HorizontalPodAutoscaler", f"{example}-serving")]
        )
        assert "onlinerl_serving_inflight_requests" in str(scaler["spec"])
    serving, config = ("Deployment", f"{example}-serving"), ("ConfigMap", f"{example}-config")
    assert a[serving] != b[serving] and a[config] != b[config]
    for key in set(a) - {serving, config}:  # other pods roll on any config change (the hash), nothing else moves
        x, y = copy.deepcopy(a[key]), copy.deepcopy(b[key])
        for m in (x, y):
            for node in _annotated(m):
                node.pop(c.ANNO_CONFIG_HASH, None)
                node.pop(c.ANNO_SPEC_HASH, None)
        assert x == y, key
    hashes = [m[serving]["spec"]["template"]["metadata"]["annotations"][c.ANNO_CONFIG_HASH] for m in (a, b)]
    assert hashes[0] != hashes[1]


def _annotated(node: Any) -> list[dict[str, Any]]:
    """Every ``annotations`` map inside a manifest."""
    if isinstance(node, list):
        return [a for item in node for a in _annotated(item)]
    if not isinstance(node, dict):
        return []
    own = [node["annotations"]] if isinstance(node.get("annotations"), dict) else []
    return own + [a for k, v in node.items() if k != "annotations" for a in _annotated(v)]


def test_a_serving_pod_template_merges_without_conflict_in_process() -> None:
    """spec.serving.podTemplate (scheduling, the pod's securityContext) reaches the in-process pod as the sidecar
    one: nothing it may set names a container."""
    fragment = {
        "metadata": {"labels": {"team": "a"}},
        "spec": {
            "nodeSelector": {"pool": "serve"},
            "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "securityContext": {"fsGroup": 10001},
        },
    }
    spec = with_mode(EXAMPLES["demo"], "inProcess", podTemplate=fragment)
    rc = RenderContext(name="demo", namespace="team-a", uid=UID, cfg=parse_spec("demo", spec))
    assert pod_template_problems(rc) == []
    deployment = next(
        m for m in render_all(rc) if m["kind"] == "Deployment" and m["metadata"]["name"] == "demo-serving"
    )
    template = deployment["spec"]["template"]
    assert template["spec"]["nodeSelector"] == {"pool": "serve"} and template["metadata"]["labels"]["team"] == "a"
    assert template["spec"]["securityContext"] == {"fsGroup": 10001}
    assert [ct["name"] for ct in template["spec"]["containers"]] == ["vllm", "reloader"]


# --- the real operator on kmock ----------------------------------------------------------------------------------
async def test_the_operator_switches_a_running_job_to_in_process_and_back(cluster: Cluster, empty_valkey) -> None:
    """A sidecar job patched to inProcess: the operator applies the serving Deployment without the gateway container
    (server-side apply removes it on a real API server: the manifest no longer names it) and with the middleware; the
    Service still targets http. Back to sidecar, the gateway container returns; at auto (the default) on the CPU engine
    image, it runs in vLLM's process again."""
    spec = {"auth": {"allowAnonymous": True}, "redis": {"url": empty_valkey.url}, "serving": {"gatewayMode": "sidecar"}}
    await cluster.apply_job("demo", spec)
    await wait_until(lambda: cluster.status("demo").get("observedGeneration") == 1, what="first reconcile")

    def pod() -> dict[str, Any]:
        return cluster.obj("Deployment", "demo-serving")["spec"]["template"]["spec"]

    assert [ct["name"] for ct in pod()["containers"]] == ["vllm", "gateway", "reloader"]
    await cluster.patch_spec("demo", {"serving": {"gatewayMode": "inProcess"}})
    await wait_until(lambda: cluster.status("demo").get("observedGeneration") == 2, what="observedGeneration 2")
    assert [ct["name"] for ct in pod()["containers"]] == ["vllm", "reloader"]
    vllm = pod()["containers"][0]
    assert vllm["args"][vllm["args"].index("--middleware") + 1] == IN_PROCESS_GATEWAY
    assert named_port(pod(), cluster.obj("Service", "demo-serving")["spec"]["ports"][0]["targetPort"])[0] == "vllm"
    assert "gatewayMode: inProcess" in cluster.obj("ConfigMap", "demo-config")["data"][c.CONFIG_FILE]
    await cluster.patch_spec("demo", {"serving": {"gatewayMode": "sidecar"}})
    await wait_until(lambda: cluster.status("demo").get("observedGeneration") == 3, what="observedGeneration 3")
    assert [ct["name"] for ct in pod()["containers"]] == ["vllm", "gateway", "reloader"]
    assert "--middleware" not in pod()["containers"][0]["args"]
    await cluster.patch_spec("demo", {"serving": {"gatewayMode": "auto"}})
    await wait_until(lambda: cluster.status("demo").get("observedGeneration") == 4, what="observedGeneration 4")
    assert [ct["name"] for ct in pod()["containers"]] == ["vllm", "reloader"]


async def test_the_operator_refuses_in_process_on_upstream_vllm(cluster: Cluster, empty_valkey) -> None:
    """GPUs, inProcess, upstream vLLM: phase Invalid with the rule's message and values, nothing deployed; setting
    images.vllm to the engine-gpu image deploys it."""
    spec = {
        "auth": {"allowAnonymous": True},
        "redis": {"url": empty_valkey.url},
        "serving": {"gpus": 1, "gatewayMode": "inProcess"},
    }
    await cluster.apply_job("demo", spec)
    await wait_until(lambda: cluster.status("demo").get("phase") == "Invalid", what="phase Invalid")
    ready = cluster.condition("demo", "Ready")
    assert ready["reason"] == "InvalidSpec" and "make images-engine-gpu" in ready["message"]
    assert (
        "(got serving.gatewayMode='inProcess', serving.gpus=1, images.vllm='vllm/vllm-openai:v0.32.0')"
        in (ready["message"])
    )
    assert cluster.obj("Deployment", "demo-serving") is None
    await cluster.patch_spec("demo", {"images": {"vllm": ENGINE_GPU_IMAGE}})
    await wait_until(lambda: cluster.obj("Deployment", "demo-serving"), what="serving after the fix")
    assert cluster.obj("Deployment", "demo-serving")["spec"]["template"]["spec"]["containers"][0]["image"] == (
        ENGINE_GPU_IMAGE
    )
