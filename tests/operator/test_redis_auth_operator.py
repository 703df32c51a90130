"""The operator against kmock: an in-cluster Redis gets a generated password Secret created once (a spec change
keeps it), NetworkPolicies beside its pods, and a missing user-provided Secret is reported by name."""

from __future__ import annotations

import base64

import pytest

from tests.operator.conftest import Cluster, wait_until

pytestmark = pytest.mark.timeout(60)


def _password(secret: dict) -> str:
    if "data" in secret:
        return base64.b64decode(secret["data"]["password"]).decode()
    return secret["stringData"]["password"]


async def test_in_cluster_redis_gets_a_password_secret_once_and_policies(cluster: Cluster) -> None:
    await cluster.apply_job("demo", {"auth": {"allowAnonymous": True}})
    secret = await wait_until(lambda: cluster.obj("Secret", "demo-redis-auth"), what="the password Secret")
    password = _password(secret)
    assert len(password) == 48 and all(ch in "0123456789abcdef" for ch in password)
    assert secret["metadata"]["ownerReferences"][0]["name"] == "demo"
    for component in ("serving", "feedback", "trainer", "redis"):
        await wait_until(
            lambda n=component: cluster.obj("NetworkPolicy", f"demo-{n}"), what=f"NetworkPolicy {component}"
        )
    redis = (await wait_until(lambda: cluster.obj("StatefulSet", "demo-redis"), what="Redis"))["spec"]["template"]
    env = {e["name"]: e["valueFrom"]["secretKeyRef"]["name"] for e in redis["spec"]["containers"][0]["env"]}
    assert env == {"REDIS_PASSWORD": "demo-redis-auth", "REDISCLI_AUTH": "demo-redis-auth"}
    await wait_until(lambda: cluster.status("demo").get("observedGeneration") == 1, what="generation 1", timeout=15)
    # A spec change re-applies every child but never the Secret: running pods keep their password.
    await cluster.patch_spec("demo", {"serving": {"replicas": 2}})
    await wait_until(lambda: cluster.status("demo").get("observedGeneration") == 2, what="generation 2", timeout=15)
    assert _password(cluster.obj("Secret", "demo-redis-auth")) == password
    assert cluster.creations("Secret", "demo-redis-auth") == 1
    assert password not in str(cluster.status("demo"))  # the operator's Redis error never carries the URL's password


async def test_a_missing_user_password_secret_is_reported_by_name(cluster: Cluster) -> None:
    await cluster.apply_job("demo", {"auth": {"allowAnonymous": True}, "redis": {"passwordSecret": "team-redis"}})
    await wait_until(
        lambda: "redis.passwordSecret 'team-redis' not found" in str(cluster.status("demo")),
        what="the missing Secret in status",
        timeout=15,
    )
    assert cluster.obj("Secret", "demo-redis-auth") is None  # nothing generated when the user names one
