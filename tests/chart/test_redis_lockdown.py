"""The chart's shared Redis, rendered by the real helm: auth on by default, a maxmemory sized from its memory, and a
NetworkPolicy (validated by kubernetes-validate) that admits only onlinerl pods."""

from __future__ import annotations

import kubernetes_validate
import pytest

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


def test_enabling_redis_renders_auth_by_default() -> None:
    docs = render(None, False, "--set", "redis.enabled=true")
    (secret,) = by_kind(docs, "Secret")
    assert len(secret["data"]["redis-password"]) >= 40  # 32 random characters, base64
    (sts,) = by_kind(docs, "StatefulSet")
    container = sts["spec"]["template"]["spec"]["containers"][0]
    assert '--requirepass "$REDIS_PASSWORD"' in container["command"][-1]
    assert {e["name"] for e in container["env"]} == {"REDIS_PASSWORD", "REDISCLI_AUTH"}
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
