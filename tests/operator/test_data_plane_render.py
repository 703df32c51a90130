"""The rendered data plane trusts nobody by default: the in-cluster Redis has one ACL user per component (passwords in a
Secret, the aclfile generated from the data-plane contract), has a
``maxmemory`` sized from its resources and volume, and NetworkPolicies admit only our pods to Redis and only the
declared ports (never vLLM's) to every pod. Every NetworkPolicy and the Secret validate (kubernetes-validate)."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
import yaml

from onlinerl.dataplane import acl
from onlinerl.dataplane.contract import Component
from onlinerl_operator import constants as c
from onlinerl_operator.render import (
    REDIS_ACL_ANNOTATION,
    REDIS_PASSWORD_ENV,
    RenderContext,
    quantity_bytes,
    redis_acl_config,
    redis_maxmemory,
    redis_password_secret,
    render_all,
)
from onlinerl_operator.spec import parse_spec
from tests.operator.test_render import SPECS, UID, by_kind, ctx_for

K8S = ("1.29", "1.33")
PASSWORDS = {u: f"{i:x}" * 48 for i, u in enumerate(Component, start=10)}  # a..f: one distinct password per user


def ctx_with(spec: dict[str, Any]) -> RenderContext:
    return RenderContext(name="demo", namespace="team-a", uid=UID, cfg=parse_spec("demo", spec))


def policies(ctx: RenderContext) -> dict[str, dict[str, Any]]:
    return {m["metadata"]["name"]: m for m in render_all(ctx) if m["kind"] == "NetworkPolicy"}


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        assert e["operator"] == "In"  # the only operator we render
        if labels.get(e["key"]) not in e["values"]:
            return False
    return True


def admits(policy: dict[str, Any], labels: dict[str, str], port: int, same_namespace: bool = True) -> bool:
    """Whether ``policy`` lets a pod with ``labels`` reach ``port`` of the pods it selects (NetworkPolicy semantics:
    any rule whose ports and peers both match)."""
    for rule in policy["spec"]["ingress"]:
        if port not in {p["port"] for p in rule["ports"]}:
            continue
        if "from" not in rule:
            return True
        for peer in rule["from"]:
            if "namespaceSelector" not in peer and not same_namespace:
                continue
            if _selects(peer["podSelector"], labels):
                return True
    return False


@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_network_policy_and_the_secret_validate(name: str) -> None:
    ctx = ctx_for(name)
    docs = list(policies(ctx).values())
    secret = redis_password_secret(ctx, PASSWORDS)
    docs += [secret] if secret else []
    assert policies(ctx), name
    for doc in docs:
        for version in K8S:
            kubernetes_validate.validate(doc, version, strict=True)


def test_redis_starts_with_the_jobs_users_and_probes_as_one() -> None:
    """Redis starts through the generated script with the job's aclfile template (from the contract) and every user's
    password from the Secret in its env; no password and no hash is ever rendered."""
    ctx = ctx_for("demo", monitoring_api=False)
    objs = by_kind(render_all(ctx))
    template = objs[("StatefulSet", "demo-redis")]["spec"]["template"]
    redis = template["spec"]["containers"][0]
    assert redis["command"][:2] == ["sh", "/etc/redis-acl/start.sh"]
    args = " ".join(redis["command"][2:])
    assert "--appendfsync always" in args and "--maxmemory-policy noeviction" in args
    assert "--requirepass" not in args and "--protected-mode" not in args
    config = objs[("ConfigMap", "demo-redis-acl")]["data"]
    assert config == {"users.acl.tpl": acl.aclfile_template("demo"), "start.sh": acl.startup_script()}
    assert "orl:\\{demo\\}:samples" in config["users.acl.tpl"]  # this job's keys only
    assert {"name": "acl", "mountPath": "/etc/redis-acl", "readOnly": True} in redis["volumeMounts"]
    volumes = {v["name"]: v for v in template["spec"]["volumes"]}
    assert volumes["acl"]["configMap"]["name"] == "demo-redis-acl"
    assert volumes["acl-run"]["emptyDir"]["medium"] == "Memory"  # the filled-in aclfile never reaches a disk
    assert template["metadata"]["annotations"][REDIS_ACL_ANNOTATION] == acl.startup_digest("demo")
    assert "--user operator ping" in redis["readinessProbe"]["exec"]["command"][2]
    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in redis["env"]}
    assert env == {
        **{f"ORL_REDIS_PW_{u.value}": {"name": "demo-redis-users", "key": u.value} for u in Component},
        "REDISCLI_AUTH": {"name": "demo-redis-users", "key": "operator"},
    }
    secret = redis_password_secret(ctx, PASSWORDS)
    assert secret["metadata"]["name"] == "demo-redis-users"
    assert secret["stringData"] == {u.value: PASSWORDS[u] for u in Component}
    assert secret["metadata"]["ownerReferences"][0]["uid"] == UID  # deleted with the job
    rendered = yaml.safe_dump(render_all(ctx))
    assert not any(p in rendered for p in PASSWORDS.values())  # no password is ever rendered into a child
    assert not any(acl.password_hash(p) in rendered for p in PASSWORDS.values())
    assert redis_acl_config(ctx_for("demo", monitoring_api=False)) == objs[("ConfigMap", "demo-redis-acl")]


def test_every_component_gets_the_password_through_its_env_never_the_config_map() -> None:
    ctx = ctx_for("demo", monitoring_api=False)
    objs = by_kind(render_all(ctx))
    serving = {ct["name"]: ct for ct in objs[("Deployment", "demo-serving")]["spec"]["template"]["spec"]["containers"]}
    pods = {  # container -> its Redis user; the demo's gateway runs in the vllm container (gatewayMode auto, CPU)
        ("vllm", "gateway"): serving["vllm"],
        ("reloader", "reloader"): serving["reloader"],
        ("feedback", "feedback"): objs[("Deployment", "demo-feedback")]["spec"]["template"]["spec"]["containers"][0],
        ("trainer", "trainer"): objs[("Job", "demo-trainer")]["spec"]["template"]["spec"]["containers"][0],
    }
    for (name, user), container in pods.items():
        env = [e["name"] for e in container["env"]]
        assert env.index(REDIS_PASSWORD_ENV) < env.index("ONLINERL__REDIS__URL"), name  # $(VAR) needs it first
        by_name = {e["name"]: e for e in container["env"]}
        assert by_name[REDIS_PASSWORD_ENV]["valueFrom"]["secretKeyRef"] == {"name": "demo-redis-users", "key": user}
        assert by_name["ONLINERL__REDIS__URL"]["value"] == (
            f"redis://{user}:$({REDIS_PASSWORD_ENV})@demo-redis.team-a.svc:6379/0"
        )
    config = yaml.safe_load(objs[("ConfigMap", "demo-config")]["data"][c.CONFIG_FILE])
    assert config["redis"]["url"] == "redis://demo-redis.team-a.svc:6379/0"  # no password in the ConfigMap


def test_a_user_provided_password_secret_is_used_and_none_is_generated() -> None:
    ctx = ctx_with({"auth": {"allowAnonymous": True}, "redis": {"passwordSecret": "my-redis"}})
    assert redis_password_secret(ctx, PASSWORDS) is None
    redis = by_kind(render_all(ctx))[("StatefulSet", "demo-redis")]["spec"]["template"]["spec"]["containers"][0]
    assert {e["valueFrom"]["secretKeyRef"]["name"] for e in redis["env"]} == {"my-redis"}


def test_an_external_redis_gets_no_password_env_and_no_redis_policy() -> None:
    ctx = ctx_for("anon-inline-redis")
    assert "demo-redis" not in policies(ctx) and redis_password_secret(ctx, PASSWORDS) is None
    assert ("ConfigMap", "anon-inline-redis-redis-acl") not in by_kind(render_all(ctx))
    gateway = by_kind(render_all(ctx))[("Deployment", "anon-inline-redis-serving")]["spec"]["template"]["spec"]
    assert REDIS_PASSWORD_ENV not in {e["name"] for ct in gateway["containers"] for e in ct.get("env", [])}


@pytest.mark.parametrize(
    ("resources", "storage", "expected"),
    [
        ({}, "8Gi", int(2**30 * 0.75)),  # the 1Gi default request
        ({"limits": {"memory": "4Gi"}, "requests": {"memory": "1Gi"}}, "100Gi", 3 * 2**30),  # the limit wins
        ({"requests": {"memory": "512Mi"}}, "8Gi", 384 * 2**20),
        ({"limits": {"memory": "4Gi"}}, "2Gi", int(2 * 2**30 * 0.4)),  # a small volume bounds it (AOF rewrite)
    ],
)
def test_maxmemory_is_sized_from_resources_and_volume(resources: dict, storage: str, expected: int) -> None:
    ctx = ctx_with({"auth": {"allowAnonymous": True}, "redis": {"resources": resources, "storageSize": storage}})
    assert redis_maxmemory(ctx) == expected
    command = by_kind(render_all(ctx))[("StatefulSet", "demo-redis")]["spec"]["template"]["spec"]["containers"][0]
    args = " ".join(command["command"][2:]) + " "
    assert f"--maxmemory {expected} " in args and "--maxmemory-policy noeviction" in args


def test_quantities() -> None:
    assert [quantity_bytes(q) for q in ("1Gi", "512Mi", "2G", "1048576", "1.5Gi")] == [
        2**30,
        2**29,
        2 * 10**9,
        2**20,
        int(1.5 * 2**30),
    ]


def test_only_our_pods_reach_redis() -> None:
    redis = policies(ctx_for("demo"))["demo-redis"]
    assert redis["spec"]["podSelector"]["matchLabels"] == {c.LABEL_JOB: "demo", c.LABEL_COMPONENT: "redis"}
    for component in ("serving", "feedback", "trainer", "rollout"):
        assert admits(redis, {c.LABEL_JOB: "demo", c.LABEL_COMPONENT: component}, 6379), component
    operator = {"app.kubernetes.io/name": "onlinerl", "app.kubernetes.io/component": "operator"}
    assert admits(redis, operator, 6379, same_namespace=False)
    hostile = [
        {},  # any other pod of the namespace
        {c.LABEL_JOB: "other", c.LABEL_COMPONENT: "trainer"},  # another job's trainer
        {c.LABEL_JOB: "demo", c.LABEL_COMPONENT: "ingress"},  # our label, not a Redis client
        {c.LABEL_JOB: "demo"},
    ]
    for labels in hostile:
        assert not admits(redis, labels, 6379), labels


def test_nothing_outside_the_serving_pod_reaches_vllm() -> None:
    ctx = ctx_for("demo")
    nps = policies(ctx)
    serving = nps["demo-serving"]
    assert serving["spec"]["podSelector"]["matchLabels"] == {c.LABEL_JOB: "demo", c.LABEL_COMPONENT: "serving"}
    assert admits(serving, {}, ctx.cfg.serving.port) and admits(serving, {}, c.RELOADER_PORT)  # API and metrics
    assert not admits(serving, {c.LABEL_JOB: "demo", c.LABEL_COMPONENT: "feedback"}, c.ENGINE_PORT)
    assert not admits(serving, {}, c.ENGINE_PORT)
    assert admits(nps["demo-feedback"], {}, ctx.cfg.feedback.port) and not admits(nps["demo-feedback"], {}, 6379)
    assert [p["port"] for p in nps["demo-trainer"]["spec"]["ingress"][0]["ports"]] == [ctx.cfg.trainer.metrics_port]
    for np in nps.values():
        assert np["spec"]["policyTypes"] == ["Ingress"]
