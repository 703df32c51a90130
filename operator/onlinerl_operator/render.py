"""Pure rendering: (job name, namespace, uid, validated config) -> the Kubernetes manifests of one OnlineRLJob.

No I/O and no clock, so the same spec always renders the same objects; the reconciler only creates or patches them.
Ports, paths and entry points follow docs/architecture.md; each pod reads the component config from the ConfigMap via
``$ONLINERL_CONFIG``. vLLM binds 127.0.0.1:8001 inside the serving pod: only the gateway port leaves the pod, and a
NetworkPolicy per component admits only its declared ports (Redis: only this job's pods and the operator). The gateway
is a container of its own (``serving.gatewayMode: sidecar``) or runs inside the vllm container's process
(``inProcess``, issue 40: :func:`serving_containers`); ``auto``, the default, picks the latter wherever the engine's
image can load it (onlinerl.vllm_flags.gateway_mode). Either way its port is the pod's ``http`` port.

The in-cluster Redis has one ACL user per component (onlinerl.dataplane.acl, generated from the data-plane contract;
``default`` off). Their passwords live in a Secret (``redis.passwordSecret``, or ``<job>-redis-users`` that the
reconciler creates once: rendering stays pure, so no password is rendered here), one key per user. Redis starts through
``acl.startup_script`` from the ConfigMap ``<job>-redis-acl`` (the aclfile template), which fills in each password's
hash from its env. Each pod gets its own user's password as ``$ONLINERL_REDIS_PASSWORD`` and its Redis URL as
``redis://<component>:$(ONLINERL_REDIS_PASSWORD)@...``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from onlinerl.config import OnlineRLConfig, ResourcesConfig
from onlinerl.continue_config import DATA_PATH, continue_config
from onlinerl.dataplane import acl
from onlinerl.dataplane.contract import Component
from onlinerl.fim import get_template
from onlinerl.model import SMOLLM2_GGUF_SHA256
from onlinerl.vllm_flags import (
    BEHAVIOUR_LOGPROBS_ARGS,
    CPU_IN_PROCESS_EXECUTOR_ARGS,
    CPU_IN_PROCESS_EXECUTOR_ENV,
    gateway_args,
    gateway_mode,
    lora_args,
)
from onlinerl_operator import constants as c
from onlinerl_operator.render_pod_template import component_fragment, customise

Manifest = dict[str, Any]
REDIS_PASSWORD_ENV = "ONLINERL_REDIS_PASSWORD"
REDIS_ACL_DIR = "/etc/redis-acl"  # the <job>-redis-acl ConfigMap: users.acl.tpl and start.sh
REDIS_RUN_DIR = "/run/redis-acl"  # in-memory emptyDir: the filled-in aclfile
REDIS_PROBE_USER = Component.OPERATOR  # the redis pod's probes authenticate as this user (PING only)
REDIS_ACL_ANNOTATION = "onlinerl.dev/redis-acl-rules"  # digest of template and script: a new contract restarts Redis
# Pods allowed to reach a job's Redis: its own components (the operator too, see redis_network_policy).
REDIS_CLIENTS = ("serving", "feedback", "trainer", "rollout")
COMPONENT_SECTIONS = ("serving", "feedback", "trainer", "redis", "rollout")  # each has a podTemplate


@dataclass(frozen=True)
class RenderContext:
    name: str
    namespace: str
    uid: str
    cfg: OnlineRLConfig
    monitoring_api: bool = False  # monitoring.coreos.com/v1 is served by this cluster
    # Optional API group/versions this cluster serves (keda.sh/v1alpha1, jobset.x-k8s.io/v1alpha2,
    # custom.metrics.k8s.io/v1beta1): render_scaling and render_trainer choose their objects by them.
    apis: frozenset[str] = frozenset()

    # --- names ------------------------------------------------------------------------------------------------
    def child(self, suffix: str) -> str:
        return f"{self.name}-{suffix}"

    @property
    def in_cluster_redis(self) -> bool:
        return not (self.cfg.redis.url or self.cfg.redis.url_secret)

    @property
    def redis_password_secret(self) -> str:
        """The Secret with the in-cluster Redis users' passwords: one key per user (``serving``, ``feedback``...).
        Not ``<job>-redis-auth``: that one held a single shared password (before ACL users) and is left alone."""
        return self.cfg.redis.password_secret or self.child("redis-users")

    @property
    def redis_acl_config(self) -> str:
        """The ConfigMap with the in-cluster Redis's aclfile template and start script (no password, no hash)."""
        return self.child("redis-acl")

    @property
    def redis_url(self) -> str:
        """The URL written into the config; empty when it comes from a Secret (env overrides it in the pod). For the
        in-cluster Redis, the URL without its password (the pods' env adds it; the ConfigMap holds no secret)."""
        if self.cfg.redis.url:
            return self.cfg.redis.url
        if self.cfg.redis.url_secret:
            return ""
        return f"redis://{self.child('redis')}.{self.namespace}.svc:{c.REDIS_PORT}/0"

    @property
    def checkpoint_claim(self) -> str:
        return self.cfg.storage.existing_claim or self.child("checkpoints")

    @property
    def model_path(self) -> str:
        """Where the model folder is inside every pod."""
        m = self.cfg.model
        if m.image:
            return c.MODEL_COPY_DIR
        if m.path:
            return m.path
        return f"{c.MODEL_COPY_DIR}/models/SmolLM2-135M-Instruct-{SMOLLM2_GGUF_SHA256[:12]}"

    @property
    def monitors_enabled(self) -> bool:
        mode = self.cfg.monitoring.service_monitor
        return mode == "on" or (mode == "auto" and self.monitoring_api)


def labels(ctx: RenderContext, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "onlinerl",
        "app.kubernetes.io/instance": ctx.name,
        "app.kubernetes.io/component": component,
        c.LABEL_MANAGED_BY: c.MANAGER,
        c.LABEL_JOB: ctx.name,
        c.LABEL_COMPONENT: component,
    }


def selector(ctx: RenderContext, component: str) -> dict[str, str]:
    return {c.LABEL_JOB: ctx.name, c.LABEL_COMPONENT: component}


def owner_reference(ctx: RenderContext) -> dict[str, Any]:
    return {
        "apiVersion": c.API_VERSION,
        "kind": c.KIND,
        "name": ctx.name,
        "uid": ctx.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def metadata(ctx: RenderContext, name: str, component: str) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": ctx.namespace,
        "labels": labels(ctx, component),
        "ownerReferences": [owner_reference(ctx)],
    }


# --- the component config -------------------------------------------------------------------------------------
def component_config(ctx: RenderContext) -> dict[str, Any]:
    """The config file every pod reads: the spec plus what only the operator knows (job, Redis URL, mount paths)."""
    data = ctx.cfg.dump()
    data["job"] = ctx.name
    data["redis"]["url"] = ctx.redis_url
    data["model"]["path"] = ctx.model_path
    data["storage"]["checkpointDir"] = c.CHECKPOINT_DIR
    data["serving"]["engineUrl"] = f"http://127.0.0.1:{c.ENGINE_PORT}"
    data["auth"]["apiKeysFile"] = f"{c.KEYS_DIR}/{c.KEYS_FILE}" if ctx.cfg.auth.api_keys_secret else ""
    return data


def config_yaml(ctx: RenderContext) -> str:
    return yaml.safe_dump(component_config(ctx), sort_keys=True)


def _hash_without_runtime_fields(ctx: RenderContext) -> str:
    """Digest of the config minus what acts at runtime (suspend: the Job; pinnedVersion, paused, rollbackTo:
    Redis), so none of them restarts a pod."""
    data = component_config(ctx)
    data["trainer"] = {**data["trainer"], "suspend": False}
    data["rollout"] = {**data["rollout"], "pinnedVersion": None, "paused": False, "rollbackTo": None}
    data.pop("scaling", None)  # autoscalers, budgets, spread: Kubernetes objects only, no component reads them
    # Pod templates, monitor labels, ingress annotations, Redis's volume: Kubernetes objects only as well (a changed
    # pod template rolls its own pods; a Redis toleration must not restart the trainer).
    data.pop("podTemplate", None)
    for section in COMPONENT_SECTIONS:
        data[section].pop("podTemplate", None)
    data["monitoring"].pop("labels", None)
    data["ingress"].pop("annotations", None)
    for key in ("storageClass", "accessMode"):
        data["redis"].pop(key, None)
    return _digest(data)


def _digest(data: Any) -> str:
    return hashlib.sha256(yaml.safe_dump(data, sort_keys=True).encode()).hexdigest()[:16]


def config_hash(ctx: RenderContext) -> str:
    """Pod-template annotation: a config change rolls the pods (they read the file only at start)."""
    return _hash_without_runtime_fields(ctx)


def config_map(ctx: RenderContext) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(ctx, ctx.child("config"), "config"),
        "data": {c.CONFIG_FILE: config_yaml(ctx)},
    }


# --- building blocks --------------------------------------------------------------------------------------------
def resources(spec: ResourcesConfig, gpus: int = 0, default_requests: dict[str, str] | None = None) -> dict[str, Any]:
    requests = {**(default_requests or {}), **spec.requests}
    limits = dict(spec.limits)
    if gpus:
        limits["nvidia.com/gpu"] = str(gpus)
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def http_probe(path: str, port: int | str, period: int = 10, failures: int = 3, initial: int = 0) -> dict[str, Any]:
    probe: dict[str, Any] = {
        "httpGet": {"path": path, "port": port},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": 5,
    }
    if initial:
        probe["initialDelaySeconds"] = initial
    return probe


def onlinerl_env(ctx: RenderContext, component: str) -> list[dict[str, Any]]:
    """Config path and Redis URL of ``component``'s containers (in-cluster Redis, or a URL Secret per user such as
    the chart's shared Redis writes: its own ACL user)."""
    env: list[dict[str, Any]] = [
        {"name": "ONLINERL_CONFIG", "value": f"{c.CONFIG_DIR}/{c.CONFIG_FILE}"},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]
    if not ctx.cfg.model.path and not ctx.cfg.model.image:
        env.append({"name": "ONLINERL_CACHE", "value": c.MODEL_COPY_DIR})  # where the init container bootstrapped
    if ctx.cfg.redis.url_secret:
        key = Component(component).value if ctx.cfg.redis.url_secret_per_user else ctx.cfg.redis.url_secret_key
        env.append(
            {
                "name": "ONLINERL__REDIS__URL",
                "valueFrom": {"secretKeyRef": {"name": ctx.cfg.redis.url_secret, "key": key}},
            }
        )
    elif ctx.in_cluster_redis:
        user = Component(component)
        env += [
            {
                "name": REDIS_PASSWORD_ENV,
                "valueFrom": {"secretKeyRef": {"name": ctx.redis_password_secret, "key": user.value}},
            },
            # Kubernetes expands $(VAR) from the variable above: the password never sits in the ConfigMap.
            {"name": "ONLINERL__REDIS__URL", "value": redis_url_for(ctx, user, f"$({REDIS_PASSWORD_ENV})")},
        ]
    return env


def redis_url_for(ctx: RenderContext, user: Component | str, password: str) -> str:
    """The in-cluster Redis URL of ACL ``user`` with ``password`` (URL-safe characters: it is not escaped)."""
    return f"redis://{Component(user).value}:{password}@{ctx.child('redis')}.{ctx.namespace}.svc:{c.REDIS_PORT}/0"


HARDENED = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def config_volume(ctx: RenderContext) -> dict[str, Any]:
    return {"name": "config", "configMap": {"name": ctx.child("config")}}


def checkpoint_volume(ctx: RenderContext) -> dict[str, Any]:
    return {"name": "checkpoints", "persistentVolumeClaim": {"claimName": ctx.checkpoint_claim}}


def model_volumes(ctx: RenderContext) -> list[dict[str, Any]]:
    m = ctx.cfg.model
    if m.claim:
        return [{"name": "models", "persistentVolumeClaim": {"claimName": m.claim, "readOnly": True}}]
    if m.path and not m.image:
        return []  # a path baked into the images or on a node: nothing to mount
    return [{"name": "model-copy", "emptyDir": {}}]


def model_mounts(ctx: RenderContext) -> list[dict[str, Any]]:
    m = ctx.cfg.model
    if m.claim:
        return [{"name": "models", "mountPath": c.MODELS_DIR, "readOnly": True}]
    if m.path and not m.image:
        return []
    return [{"name": "model-copy", "mountPath": c.MODEL_COPY_DIR}]


def model_init_containers(ctx: RenderContext) -> list[dict[str, Any]]:
    """Bring the model folder into the pod: copy it out of ``model.image``, or bootstrap SmolLM2 (CPU demo)."""
    m = ctx.cfg.model
    pull = ctx.cfg.images.pull_policy
    mount = [{"name": "model-copy", "mountPath": c.MODEL_COPY_DIR}]
    if m.image:
        return [
            {
                "name": "model",
                "image": m.image,
                "imagePullPolicy": pull,
                "command": ["sh", "-c"],
                "args": [f'cp -a "{m.path}/." {c.MODEL_COPY_DIR}/'],
                "volumeMounts": mount,
            }
        ]
    if not m.path and not m.claim:
        return [
            {
                "name": "model-bootstrap",
                "image": ctx.cfg.images.trainer,
                "imagePullPolicy": pull,
                "command": ["onlinerl", "model", "bootstrap", "--cache-dir", c.MODEL_COPY_DIR],
                "volumeMounts": mount,
                "securityContext": HARDENED,
            }
        ]
    return []


def pod_annotations(ctx: RenderContext) -> dict[str, str]:
    return {c.ANNO_CONFIG_HASH: config_hash(ctx)}


# --- serving --------------------------------------------------------------------------------------------------
def vllm_args(ctx: RenderContext) -> list[str]:
    cfg = ctx.cfg
    args = [
        "--model",
        ctx.model_path,
        "--served-model-name",
        cfg.model.served_name,
        "--host",
        "127.0.0.1",
        "--port",
        str(c.ENGINE_PORT),
        "--max-model-len",
        str(cfg.model.max_model_len),
        "--dtype",
        cfg.model.dtype,
    ]
    args += lora_args(cfg)  # the same LoRA flags as the local stack (onlinerl/vllm_flags.py)
    args += gateway_args(gateway_mode(cfg))  # in vLLM's process: the gateway as its middleware, as the local stack
    if cfg.serving.gpus > 1:
        args += ["--tensor-parallel-size", str(cfg.serving.gpus)]
    if cfg.serving.gpus == 0:
        args += CPU_IN_PROCESS_EXECUTOR_ARGS  # no busy-waiting executor core (onlinerl/vllm_flags.py)
    # Behaviour log-probs under the sampled distribution (after temperature), last so vllmArgs cannot undo it.
    return args + list(cfg.serving.vllm_args) + list(BEHAVIOUR_LOGPROBS_ARGS)


def _engine_health_probe(period: int, failures: int) -> dict[str, Any]:
    # vLLM listens on loopback only, so the kubelet cannot httpGet it: probe from inside the container.
    check = f"import urllib.request; urllib.request.urlopen('http://127.0.0.1:{c.ENGINE_PORT}/health', timeout=4)"
    return {
        "exec": {"command": ["python3", "-c", check]},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": 5,
    }


def vllm_container(ctx: RenderContext) -> dict[str, Any]:
    """vLLM's OpenAI server on loopback; in ``inProcess`` mode also the gateway, which its middleware starts on
    ``serving.port`` (:func:`with_gateway_inside`)."""
    cfg = ctx.cfg
    gpu = cfg.serving.gpus > 0
    env = [{"name": "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "value": "True"}]
    if cfg.serving.weights_mode == "full":
        env.append({"name": "VLLM_SERVER_DEV_MODE", "value": "1"})  # pause/reload_weights: loopback only
    if not gpu:
        env.append({"name": "VLLM_CPU_KVCACHE_SPACE", "value": "1"})
        env += [{"name": k, "value": v} for k, v in CPU_IN_PROCESS_EXECUTOR_ENV.items()]
    mounts = [
        {"name": "checkpoints", "mountPath": c.CHECKPOINT_DIR, "readOnly": True},
        {"name": "dshm", "mountPath": "/dev/shm"},
        *model_mounts(ctx),
    ]
    container = {
        "name": "vllm",
        "image": cfg.images.vllm if gpu else cfg.images.vllm_cpu,
        "imagePullPolicy": cfg.images.pull_policy,
        "command": ["python3", "-m", "vllm.entrypoints.openai.api_server"],
        "args": vllm_args(ctx),
        "env": env,
        "resources": resources(
            cfg.serving.resources,
            cfg.serving.gpus,
            None if cfg.serving.resources.requests else {"cpu": "1", "memory": "4Gi"},
        ),
        "volumeMounts": mounts,
        "startupProbe": _engine_health_probe(period=10, failures=180),
        "livenessProbe": _engine_health_probe(period=30, failures=3),
    }
    return with_gateway_inside(ctx, container) if in_process_gateway(ctx) else container


def in_process_gateway(ctx: RenderContext) -> bool:
    """The gateway runs in the vllm container's process, no container of its own (issue 40: no second hop between
    the gateway and vLLM): ``serving.gatewayMode: inProcess``, or ``auto`` on an engine image that can load it."""
    return gateway_mode(ctx.cfg) == "inProcess"


def _gateway_port(ctx: RenderContext) -> dict[str, Any]:
    """The pod's ``http`` port (the Service's target, the monitors' and the NetworkPolicy's), whichever container
    runs the gateway."""
    return {"name": "http", "containerPort": ctx.cfg.serving.port, "protocol": "TCP"}


def _gateway_probes() -> dict[str, Any]:
    """Ready once the gateway reaches vLLM and Redis (/readyz); alive while its event loop answers (/healthz)."""
    return {
        "readinessProbe": http_probe("/readyz", "http", period=5),
        "livenessProbe": http_probe("/healthz", "http", period=10, initial=5),
    }


def merged_env(*groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The groups' variables in order, each name once (the first group that sets it wins): a ``$(VAR)`` reference
    still follows the variable it names."""
    seen: set[str] = set()
    out = []
    for group in groups:
        for var in group:
            if var["name"] not in seen:
                seen.add(var["name"])
                out.append(var)
    return out


def with_gateway_inside(ctx: RenderContext, vllm: dict[str, Any]) -> dict[str, Any]:
    """The vllm container carrying the gateway (``inProcess``): what the gateway container had that its code needs
    in vLLM's process (its env: config path and its own Redis user; the config and API-keys mounts), the ``http``
    port, and the gateway's probes in place of vLLM's liveness. vLLM's startup probe stays: the gateway listens only
    once vLLM's app has started (vLLM's ASGI lifespan), and then its /healthz answers from vLLM's own event loop.
    vLLM itself stays on 127.0.0.1 (its admin routes never leave the pod). The process now faces clients, so it gets
    no privilege escalation; its capabilities are kept, as the trainer's multi-GPU processes keep theirs (the sidecar
    dropped all of them; vLLM's GPU workers were never run here without them)."""
    return {
        **vllm,
        "ports": [_gateway_port(ctx)],
        "env": merged_env(vllm["env"], onlinerl_env(ctx, "gateway")),
        "volumeMounts": [*vllm["volumeMounts"], *_config_mounts(ctx)],
        **_gateway_probes(),
        "securityContext": {"allowPrivilegeEscalation": False},
    }


def gateway_container(ctx: RenderContext) -> dict[str, Any]:
    return {
        "name": "gateway",
        "image": ctx.cfg.images.serving,
        "imagePullPolicy": ctx.cfg.images.pull_policy,
        "command": ["python", "-m", "onlinerl_serving.gateway"],
        "ports": [_gateway_port(ctx)],
        "env": onlinerl_env(ctx, "gateway"),
        "resources": {"requests": {"cpu": "250m", "memory": "256Mi"}},
        "volumeMounts": _config_mounts(ctx),
        **_gateway_probes(),
        "securityContext": HARDENED,
    }


def serving_containers(ctx: RenderContext) -> list[dict[str, Any]]:
    """vLLM, the gateway (a container of its own unless it runs inside vLLM's process) and the reloader."""
    gateway = [] if in_process_gateway(ctx) else [gateway_container(ctx)]
    return [vllm_container(ctx), *gateway, reloader_container(ctx)]


def reloader_container(ctx: RenderContext) -> dict[str, Any]:
    return {
        "name": "reloader",
        "image": ctx.cfg.images.serving,
        "imagePullPolicy": ctx.cfg.images.pull_policy,
        "command": ["python", "-m", "onlinerl_serving.reloader"],
        "ports": [{"name": "reloader", "containerPort": c.RELOADER_PORT, "protocol": "TCP"}],
        "env": onlinerl_env(ctx, "reloader"),
        "resources": {"requests": {"cpu": "50m", "memory": "128Mi"}},
        "volumeMounts": [
            *_config_mounts(ctx),
            {"name": "checkpoints", "mountPath": c.CHECKPOINT_DIR, "readOnly": True},
        ],
        "livenessProbe": http_probe("/healthz", "reloader", period=10, initial=5),
        "securityContext": HARDENED,
    }


def _config_mounts(ctx: RenderContext) -> list[dict[str, Any]]:
    mounts = [{"name": "config", "mountPath": c.CONFIG_DIR, "readOnly": True}]
    if ctx.cfg.auth.api_keys_secret:
        mounts.append({"name": "api-keys", "mountPath": c.KEYS_DIR, "readOnly": True})
    return mounts


def _keys_volumes(ctx: RenderContext) -> list[dict[str, Any]]:
    if not ctx.cfg.auth.api_keys_secret:
        return []
    return [
        {
            "name": "api-keys",
            "secret": {
                "secretName": ctx.cfg.auth.api_keys_secret,
                "items": [{"key": c.KEYS_FILE, "path": c.KEYS_FILE}],
            },
        }
    ]


def serving_deployment(ctx: RenderContext) -> Manifest:
    volumes = [
        config_volume(ctx),
        checkpoint_volume(ctx),
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
        *_keys_volumes(ctx),
        *model_volumes(ctx),
    ]
    pod: dict[str, Any] = {
        "initContainers": model_init_containers(ctx),
        "containers": serving_containers(ctx),
        "volumes": volumes,
        # In-flight streams finish before the pod goes (serving.drainTimeoutSeconds).
        "terminationGracePeriodSeconds": int(ctx.cfg.serving.drain_timeout_seconds) + 10,
    }
    if not pod["initContainers"]:
        del pod["initContainers"]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(ctx, ctx.child("serving"), "serving"),
        "spec": {
            "replicas": ctx.cfg.serving.replicas,
            "selector": {"matchLabels": selector(ctx, "serving")},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": {
                "metadata": {"labels": labels(ctx, "serving"), "annotations": pod_annotations(ctx)},
                "spec": pod,
            },
        },
    }


def service(ctx: RenderContext, component: str, port_name: str, port: int) -> Manifest:
    meta = metadata(ctx, ctx.child(component), component)
    meta["labels"]["onlinerl.dev/metrics"] = "true"
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta,
        "spec": {
            "type": "ClusterIP",
            "selector": selector(ctx, component),
            "ports": [{"name": port_name, "port": port, "targetPort": port_name, "protocol": "TCP"}],
        },
    }


def serving_service(ctx: RenderContext) -> Manifest:
    return service(ctx, "serving", "http", ctx.cfg.serving.port)


# --- feedback -------------------------------------------------------------------------------------------------
def feedback_deployment(ctx: RenderContext) -> Manifest:
    cfg = ctx.cfg
    container = {
        "name": "feedback",
        "image": cfg.images.feedback,
        "imagePullPolicy": cfg.images.pull_policy,
        "command": ["python", "-m", "onlinerl_feedback"],
        "ports": [{"name": "http", "containerPort": cfg.feedback.port, "protocol": "TCP"}],
        "env": onlinerl_env(ctx, "feedback"),
        "resources": resources(
            cfg.feedback.resources, 0, None if cfg.feedback.resources.requests else {"cpu": "250m", "memory": "256Mi"}
        ),
        "volumeMounts": [*_config_mounts(ctx), *model_mounts(ctx)],
        "readinessProbe": http_probe("/readyz", "http", period=5),
        "livenessProbe": http_probe("/healthz", "http", period=10, initial=5),
        "securityContext": HARDENED,
    }
    # The join reads the model's tokenizer (onlinerl/tokens.py): from model.image only config and tokenizer files.
    init = model_init_containers(ctx)
    if cfg.model.image:
        init[0]["args"] = [f'cp "{cfg.model.path}"/config.json "{cfg.model.path}"/tokenizer*.json {c.MODEL_COPY_DIR}/']
    pod: dict[str, Any] = {"containers": [container], "volumes": [config_volume(ctx), *_keys_volumes(ctx)]}
    pod["volumes"] += model_volumes(ctx)
    if init:
        pod["initContainers"] = init
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(ctx, ctx.child("feedback"), "feedback"),
        "spec": {
            "replicas": cfg.feedback.replicas,
            "selector": {"matchLabels": selector(ctx, "feedback")},
            "template": {
                "metadata": {"labels": labels(ctx, "feedback"), "annotations": pod_annotations(ctx)},
                "spec": pod,
            },
        },
    }


def feedback_service(ctx: RenderContext) -> Manifest:
    return service(ctx, "feedback", "http", ctx.cfg.feedback.port)


# --- rollout controller (strategy canary) ------------------------------------------------------------------------
def rollout_deployment(ctx: RenderContext) -> Manifest | None:
    """The eval gate and canary / blue-green controller: one replica, unless ``rollout.strategy: direct``.

    An init container builds the held-out FIM split the gate evaluates on (the standard library of the image), and
    the gate reaches the serving Service with the job's own API key, like any client.
    """
    cfg = ctx.cfg
    if not cfg.rollout.controlled:
        return None
    image = {"image": cfg.images.rollout, "imagePullPolicy": cfg.images.pull_policy, "securityContext": HARDENED}
    data_mount = {"name": "eval-data", "mountPath": c.EVAL_DATA_DIR}
    init = {
        "name": "eval-data",
        **image,
        "command": ["onlinerl", "data", "build", "--out", c.EVAL_DATA_DIR],
        "volumeMounts": [data_mount],
    }
    env = [
        *onlinerl_env(ctx, "rollout"),
        {"name": "ONLINERL_ROLLOUT_PORT", "value": str(c.ROLLOUT_PORT)},
        {"name": "ONLINERL_ROLLOUT_EVALUATOR", "value": c.GATE_EVALUATOR},
        {"name": "ONLINERL_EVAL_DATA", "value": f"{c.EVAL_DATA_DIR}/test.jsonl"},
        {"name": "ONLINERL_GATEWAY_URL", "value": f"http://{ctx.child('serving')}:{cfg.serving.port}"},
    ]
    container = {
        "name": "rollout",
        **image,
        "command": ["python", "-m", "onlinerl_rollout"],
        "ports": [{"name": "metrics", "containerPort": c.ROLLOUT_PORT, "protocol": "TCP"}],
        "env": env,
        "resources": resources(cfg.feedback.resources, 0, {"cpu": "100m", "memory": "256Mi"}),
        "volumeMounts": [*_config_mounts(ctx), data_mount],
        "livenessProbe": http_probe("/healthz", "metrics", period=15, failures=4, initial=10),
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(ctx, ctx.child("rollout"), "rollout"),
        "spec": {
            "replicas": 1,
            "strategy": {"type": "Recreate"},  # one controller at a time: decisions are serialised
            "selector": {"matchLabels": selector(ctx, "rollout")},
            "template": {
                "metadata": {"labels": labels(ctx, "rollout"), "annotations": pod_annotations(ctx)},
                "spec": {
                    "initContainers": [init],
                    "containers": [container],
                    "volumes": [config_volume(ctx), *_keys_volumes(ctx), {"name": "eval-data", "emptyDir": {}}],
                },
            },
        },
    }


def rollout_service(ctx: RenderContext) -> Manifest | None:
    """Metrics of the controller, picked up by the job's ServiceMonitor (port ``metrics``)."""
    return service(ctx, "rollout", "metrics", c.ROLLOUT_PORT) if ctx.cfg.rollout.controlled else None


# --- trainer --------------------------------------------------------------------------------------------------
def trainer_command(ctx: RenderContext) -> list[str]:
    """One process for <= 1 GPU; the DeepSpeed launcher (one rank per GPU) above that."""
    gpus = ctx.cfg.trainer.gpus
    if gpus > 1:
        return ["deepspeed", "--num_gpus", str(gpus), "--master_port", "29500", "--module", "onlinerl_trainer"]
    return ["python", "-m", "onlinerl_trainer"]


def trainer_job(ctx: RenderContext) -> Manifest:
    """The trainer as a Job: it resumes by itself from the latest checkpoint + trainer-state on the shared volume.

    ``backoffLimit`` retries a crashed pod in place; when the Job itself fails, the operator recreates it with
    exponential backoff (``trainer.maxRestarts``). ``suspend`` stops the pods while serving keeps running.
    """
    cfg = ctx.cfg
    port = cfg.trainer.metrics_port
    container = {
        "name": "trainer",
        "image": cfg.images.trainer,
        "imagePullPolicy": cfg.images.pull_policy,
        "command": trainer_command(ctx),
        "ports": [{"name": "metrics", "containerPort": port, "protocol": "TCP"}],
        "env": onlinerl_env(ctx, "trainer"),
        "resources": resources(
            cfg.trainer.resources,
            cfg.trainer.gpus,
            None if cfg.trainer.resources.requests else {"cpu": "1", "memory": "4Gi"},
        ),
        "volumeMounts": [
            {"name": "config", "mountPath": c.CONFIG_DIR, "readOnly": True},
            {"name": "checkpoints", "mountPath": c.CHECKPOINT_DIR},
            {"name": "dshm", "mountPath": "/dev/shm"},
            *model_mounts(ctx),
        ],
        "startupProbe": http_probe("/healthz", "metrics", period=10, failures=60),
        "livenessProbe": http_probe("/healthz", "metrics", period=15, failures=4),
        "securityContext": {"allowPrivilegeEscalation": False},
    }
    pod: dict[str, Any] = {
        "restartPolicy": "Never",
        "containers": [container],
        "volumes": [
            config_volume(ctx),
            checkpoint_volume(ctx),
            {"name": "dshm", "emptyDir": {"medium": "Memory"}},
            *model_volumes(ctx),
        ],
        "terminationGracePeriodSeconds": 120,  # lets the trainer finish writing a checkpoint
    }
    init = model_init_containers(ctx)
    if init:
        pod["initContainers"] = init
    meta = metadata(ctx, ctx.child("trainer"), "trainer")
    meta["annotations"] = {c.ANNO_SPEC_HASH: trainer_hash(ctx)}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": meta,
        "spec": {
            "backoffLimit": 2,
            "suspend": cfg.trainer.suspend,
            "template": {
                "metadata": {"labels": labels(ctx, "trainer"), "annotations": pod_annotations(ctx)},
                "spec": pod,
            },
        },
    }


def trainer_hash(ctx: RenderContext) -> str:
    """What forces a new trainer Job (its pod template is immutable): any config change but suspend/pin, and the
    trainer's pod-template fragment (the job-wide one merged with spec.trainer.podTemplate)."""
    fragment = component_fragment(ctx.cfg, "trainer")
    base = _hash_without_runtime_fields(ctx)
    return _digest({"config": base, "podTemplate": fragment}) if any(fragment.values()) else base


def trainer_service(ctx: RenderContext) -> Manifest:
    return service(ctx, "trainer", "metrics", ctx.cfg.trainer.metrics_port)


# --- storage, ingress, monitoring, redis ----------------------------------------------------------------------
def checkpoint_pvc(ctx: RenderContext) -> Manifest | None:
    st = ctx.cfg.storage
    if st.existing_claim:
        return None
    spec: dict[str, Any] = {"accessModes": [st.access_mode], "resources": {"requests": {"storage": st.size}}}
    if st.storage_class:
        spec["storageClassName"] = st.storage_class
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": metadata(ctx, ctx.child("checkpoints"), "storage"),
        "spec": spec,
    }


def ingress(ctx: RenderContext) -> Manifest | None:
    ing = ctx.cfg.ingress
    if not ing.enabled:
        return None

    def path(prefix: str, component: str, port: int) -> dict[str, Any]:
        return {
            "path": prefix,
            "pathType": "Prefix",
            "backend": {"service": {"name": ctx.child(component), "port": {"number": port}}},
        }

    rule: dict[str, Any] = {
        "http": {
            "paths": [
                path("/v1", "serving", ctx.cfg.serving.port),
                path("/api/training", "feedback", ctx.cfg.feedback.port),
            ]
        }
    }
    if ing.host:
        rule["host"] = ing.host
    spec: dict[str, Any] = {"rules": [rule]}
    if ing.class_name:
        spec["ingressClassName"] = ing.class_name
    if ing.tls_secret:
        spec["tls"] = [{"hosts": [ing.host], "secretName": ing.tls_secret}]
    meta = metadata(ctx, ctx.name, "ingress")
    if ing.annotations:
        meta["annotations"] = dict(ing.annotations)
    return {"apiVersion": "networking.k8s.io/v1", "kind": "Ingress", "metadata": meta, "spec": spec}


def monitor_metadata(ctx: RenderContext, name: str) -> dict[str, Any]:
    """A monitor's metadata with ``monitoring.labels`` (what the Prometheus selects them by); ours win on a clash."""
    meta = metadata(ctx, name, "monitoring")
    meta["labels"] = {**ctx.cfg.monitoring.labels, **meta["labels"]}
    return meta


def service_monitor(ctx: RenderContext) -> Manifest:
    """Scrapes the gateway, feedback and trainer Services (all labelled onlinerl.dev/metrics=true)."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": monitor_metadata(ctx, ctx.name),
        "spec": {
            "selector": {"matchLabels": {c.LABEL_JOB: ctx.name, "onlinerl.dev/metrics": "true"}},
            # Series carry the job label, so alerts and dashboards can tell two jobs in one namespace apart.
            "targetLabels": [c.LABEL_JOB],
            "endpoints": [
                {"port": "http", "path": "/metrics", "interval": "30s"},
                {"port": "metrics", "path": "/metrics", "interval": "30s"},
            ],
        },
    }


def pod_monitor(ctx: RenderContext) -> Manifest:
    """Per-replica series of the serving pods: the reloader (its port has no Service) and vLLM's own metrics,
    which the gateway relays at ``/engine/metrics`` because vLLM listens on loopback only."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": monitor_metadata(ctx, ctx.child("reloader")),
        "spec": {
            "selector": {"matchLabels": selector(ctx, "serving")},
            "podTargetLabels": [c.LABEL_JOB],
            "podMetricsEndpoints": [
                {"port": "reloader", "path": "/metrics", "interval": "30s"},
                {"port": "http", "path": "/engine/metrics", "interval": "30s"},
            ],
        },
    }


_QUANTITY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def quantity_bytes(q: str) -> int:
    """A Kubernetes memory/storage quantity (``1Gi``, ``512Mi``, ``2G``, ``1048576``) in bytes."""
    q = str(q).strip()
    for suffix, factor in _QUANTITY.items():
        if q.endswith(suffix):
            return int(float(q[: -len(suffix)]) * factor)
    return int(float(q))


def redis_maxmemory(ctx: RenderContext) -> int:
    """``maxmemory`` in bytes: 75 % of the container's memory (limit, else request, else the 1Gi default request),
    leaving room for the AOF rewrite's fork and buffers; and at most 40 % of the volume, since the AOF plus its rewrite
    need about twice the data set on disk. Policy noeviction: at the limit writes fail loudly, samples never vanish."""
    r = ctx.cfg.redis.resources
    memory = r.limits.get("memory") or r.requests.get("memory") or "1Gi"
    return min(int(quantity_bytes(memory) * 0.75), int(quantity_bytes(ctx.cfg.redis.storage_size) * 0.4))


def redis_statefulset(ctx: RenderContext) -> Manifest:
    """In-cluster Redis with the durability docs/architecture.md requires (AOF, fsync always, noeviction), one ACL
    user per component from the job's aclfile Secret (``default`` off) and a ``maxmemory`` sized from its resources
    and volume. The pod template carries the rules' digest: a new contract restarts Redis with the new aclfile."""
    cfg = ctx.cfg
    server = [
        *("--port", "6379", "--dir", "/data", "--appendonly", "yes", "--appendfsync", "always"),
        *("--maxmemory-policy", "noeviction", "--maxmemory", str(redis_maxmemory(ctx))),
    ]
    # REDISCLI_AUTH: the CLI authenticates (as the probe user, allowed PING) without the password on its command line.
    cli = "$(command -v valkey-cli || command -v redis-cli)"
    ping = ["sh", "-c", f"{cli} --user {REDIS_PROBE_USER.value} ping | grep -q PONG"]

    def password(user: Component) -> dict[str, Any]:
        return {"secretKeyRef": {"name": ctx.redis_password_secret, "key": user.value}}

    container = {
        "name": "redis",
        "image": cfg.images.redis,
        "imagePullPolicy": cfg.images.pull_policy,
        "command": ["sh", f"{REDIS_ACL_DIR}/start.sh", *server],
        "env": [
            *({"name": f"{acl.PASSWORD_ENV_PREFIX}{u.value}", "valueFrom": password(u)} for u in acl.USERS),
            {"name": "REDISCLI_AUTH", "valueFrom": password(REDIS_PROBE_USER)},
        ],
        "ports": [{"name": "redis", "containerPort": c.REDIS_PORT, "protocol": "TCP"}],
        "resources": resources(
            cfg.redis.resources, 0, None if cfg.redis.resources.requests else {"cpu": "250m", "memory": "1Gi"}
        ),
        "volumeMounts": [
            {"name": "data", "mountPath": "/data"},
            {"name": "acl", "mountPath": REDIS_ACL_DIR, "readOnly": True},
            {"name": "acl-run", "mountPath": REDIS_RUN_DIR},
        ],
        "readinessProbe": {"exec": {"command": ping}, "periodSeconds": 5, "timeoutSeconds": 3},
        "livenessProbe": {"exec": {"command": ping}, "periodSeconds": 15, "timeoutSeconds": 5, "failureThreshold": 4},
        "securityContext": HARDENED,
    }
    claim: dict[str, Any] = {
        "metadata": {"name": "data", "labels": labels(ctx, "redis")},
        "spec": {
            "accessModes": [cfg.redis.access_mode],
            "resources": {"requests": {"storage": cfg.redis.storage_size}},
        },
    }
    if cfg.redis.storage_class:  # its own class: empty leaves the cluster's default (never the checkpoints' class)
        claim["spec"]["storageClassName"] = cfg.redis.storage_class
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": metadata(ctx, ctx.child("redis"), "redis"),
        "spec": {
            "serviceName": ctx.child("redis"),
            "replicas": 1,
            "selector": {"matchLabels": selector(ctx, "redis")},
            "template": {
                "metadata": {
                    "labels": labels(ctx, "redis"),
                    "annotations": {REDIS_ACL_ANNOTATION: acl.startup_digest(ctx.name)},
                },
                "spec": {
                    "containers": [container],
                    "volumes": [
                        {"name": "acl", "configMap": {"name": ctx.redis_acl_config, "defaultMode": 0o444}},
                        {"name": "acl-run", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}},
                    ],
                    "terminationGracePeriodSeconds": 30,
                },
            },
            "volumeClaimTemplates": [claim],
        },
    }


def redis_service(ctx: RenderContext) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(ctx, ctx.child("redis"), "redis"),
        "spec": {
            "type": "ClusterIP",
            "selector": selector(ctx, "redis"),
            "ports": [{"name": "redis", "port": c.REDIS_PORT, "targetPort": "redis", "protocol": "TCP"}],
        },
    }


def redis_password_secret(ctx: RenderContext, passwords: Mapping[Component, str]) -> Manifest | None:
    """The job's generated Redis users' password Secret, one key per user (None when the user names one, or Redis is
    not in-cluster). The reconciler creates it once and only ever adds missing users (never applies it again: that
    would change passwords under running pods)."""
    if not ctx.in_cluster_redis or ctx.cfg.redis.password_secret:
        return None
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": metadata(ctx, ctx.redis_password_secret, "redis"),
        "type": "Opaque",
        "stringData": {u.value: passwords[u] for u in acl.USERS},
    }


def redis_acl_config(ctx: RenderContext) -> Manifest:
    """The in-cluster Redis's aclfile template (the job's users, generated from the data-plane contract, with a
    placeholder for each password hash) and the script that fills it in from the env and starts the server."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(ctx, ctx.redis_acl_config, "redis"),
        "data": {"users.acl.tpl": acl.aclfile_template(ctx.name), "start.sh": acl.startup_script()},
    }


def network_policy(ctx: RenderContext, component: str, ports: list[int], sources: list[dict] | None) -> Manifest:
    """Ingress to ``component``'s pods only on ``ports``; from ``sources`` (None: from anywhere)."""
    rule: dict[str, Any] = {"ports": [{"protocol": "TCP", "port": p} for p in ports]}
    if sources is not None:
        rule["from"] = sources
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(ctx, ctx.child(component), component),
        "spec": {
            "podSelector": {"matchLabels": selector(ctx, component)},
            "policyTypes": ["Ingress"],
            "ingress": [rule],
        },
    }


def network_policies(ctx: RenderContext) -> list[Manifest]:
    """Every pod admits only its declared ports. The serving pod: the gateway (its own container's ``http`` port,
    or the vllm container's in inProcess mode) and the reloader's metrics, never vLLM's port (vLLM binds 127.0.0.1 as
    well). Redis: only this job's components and the operator (any namespace)."""
    cfg = ctx.cfg
    out = [
        network_policy(ctx, "serving", [cfg.serving.port, c.RELOADER_PORT], None),
        network_policy(ctx, "feedback", [cfg.feedback.port], None),
        network_policy(ctx, "trainer", [cfg.trainer.metrics_port], None),
    ]
    if cfg.rollout.controlled:
        out.append(network_policy(ctx, "rollout", [c.ROLLOUT_PORT], None))
    if ctx.in_cluster_redis:
        ours = {
            "podSelector": {
                "matchLabels": {c.LABEL_JOB: ctx.name},
                "matchExpressions": [{"key": c.LABEL_COMPONENT, "operator": "In", "values": list(REDIS_CLIENTS)}],
            }
        }
        operator = {
            "namespaceSelector": {},
            "podSelector": {
                "matchLabels": {"app.kubernetes.io/name": "onlinerl", "app.kubernetes.io/component": "operator"}
            },
        }
        out.append(network_policy(ctx, "redis", [c.REDIS_PORT], [ours, operator]))
    return out


def render_all(ctx: RenderContext) -> list[Manifest]:
    """Every child in apply order (config and storage before the pods that mount them). The trainer workload (Job,
    Indexed Job or JobSet: render_trainer) included; autoscalers and disruption budgets: render_scaling."""
    from onlinerl_operator import render_scaling as scaling  # they build on this module's helpers
    from onlinerl_operator import render_trainer as trainer

    pods = workloads(ctx)[0]
    out: list[Manifest | None] = [config_map(ctx), checkpoint_pvc(ctx)]
    if ctx.in_cluster_redis:
        out += [redis_acl_config(ctx), redis_service(ctx), pods["redis"]]
    policies = [
        trainer.shape_trainer_policy(ctx, p) if p["metadata"]["name"] == ctx.child("trainer") else p
        for p in network_policies(ctx)
    ]
    out += [
        pods["serving"],
        serving_service(ctx),
        pods["feedback"],
        feedback_service(ctx),
        trainer.metrics_service(ctx),
        trainer.rendezvous_service(ctx),
        pods["trainer"],
        pods["rollout"],
        rollout_service(ctx),
        ingress(ctx),
        *policies,
        *scaling.scaling_manifests(ctx),
    ]
    if ctx.monitors_enabled:
        out += [service_monitor(ctx), pod_monitor(ctx)]
    return [m for m in out if m is not None]


def workloads(ctx: RenderContext) -> tuple[dict[str, Manifest | None], list[str]]:
    """Each component's workload (None where the spec wants none) with its pod-template fragment merged in, and the
    fragments' conflicts with what the operator owns (render_pod_template)."""
    from onlinerl_operator import render_scaling as scaling
    from onlinerl_operator import render_trainer as trainer

    raw: dict[str, Manifest | None] = {
        "redis": redis_statefulset(ctx) if ctx.in_cluster_redis else None,
        "serving": scaling.shape_deployment(ctx, "serving", serving_deployment(ctx)),
        "feedback": scaling.shape_deployment(ctx, "feedback", feedback_deployment(ctx)),
        "trainer": trainer.operator_trainer_workload(ctx),
        "rollout": rollout_deployment(ctx),
    }
    out: dict[str, Manifest | None] = {}
    conflicts: list[str] = []
    for component, manifest in raw.items():
        if manifest is None:
            out[component] = None
            continue
        out[component], found = customise(ctx.cfg, component, manifest)
        conflicts += found
    return out, conflicts


def pod_template_problems(ctx: RenderContext) -> list[str]:
    """Fragments that ask to change what the operator owns (it keeps its value): one line each."""
    return workloads(ctx)[1]


API_KEY_PLACEHOLDER = "<your-api-key>"  # status never holds a key: the user puts one of spec.auth's keys there


def endpoints(ctx: RenderContext) -> dict[str, str]:
    """In-cluster URLs, the ingress, and the config.yaml for stock Continue (onlinerl/continue_config.py, the one
    `onlinerl up` prints): through the ingress when there is one (/v1, /api/training on one host), else in-cluster."""
    base = f"{ctx.namespace}.svc"
    scheme = "https" if ctx.cfg.ingress.tls_secret else "http"
    serving = f"http://{ctx.child('serving')}.{base}:{ctx.cfg.serving.port}"
    feedback = f"http://{ctx.child('feedback')}.{base}:{ctx.cfg.feedback.port}"
    ingress = f"{scheme}://{ctx.cfg.ingress.host}" if ctx.cfg.ingress.enabled and ctx.cfg.ingress.host else ""
    model = ctx.cfg.model
    return {
        "completions": f"{serving}/v1/completions",
        "feedback": f"{feedback}{DATA_PATH}",
        "ingress": ingress,
        "continueConfig": continue_config(
            model=model.served_name,
            api_base=f"{ingress or serving}/v1",
            feedback_base=ingress or feedback,
            api_key=API_KEY_PLACEHOLDER,
            max_model_len=model.max_model_len,
            template=get_template(model.fim_template) if model.fim_template != "auto" else None,
        ),
    }
