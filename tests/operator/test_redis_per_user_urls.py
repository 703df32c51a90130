"""A job on a shared Redis with one URL per user (``redis.urlSecretPerUser``, what the chart's shared Redis writes for
each job of ``redis.jobs``): every container connects as its own user, the operator as ``operator``, so a job's pods
hold the same least rights on the shared server as on a Redis of their own (issue 35)."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from onlinerl.dataplane import acl
from onlinerl.dataplane.contract import Component
from onlinerl.valkey import EmbeddedValkey, RedisUsers
from onlinerl_operator.render import RenderContext, render_all
from onlinerl_operator.spec import parse_spec
from tests.operator.conftest import NS, Cluster, wait_until
from tests.operator.test_render import UID, by_kind

SPEC = {"auth": {"allowAnonymous": True}, "redis": {"urlSecret": "demo-redis-urls", "urlSecretPerUser": True}}


def containers(manifests: list[dict]) -> dict[str, dict]:
    objs = by_kind(manifests)
    pods = [
        objs[("Deployment", "demo-serving")],
        objs[("Deployment", "demo-feedback")],
        objs[("Deployment", "demo-rollout")],
        objs[("Job", "demo-trainer")],
    ]
    return {ct["name"]: ct for pod in pods for ct in pod["spec"]["template"]["spec"]["containers"]}


def redis_url_ref(container: dict) -> dict | None:
    env = {e["name"]: e for e in container.get("env", [])}
    url = env.get("ONLINERL__REDIS__URL")
    return None if url is None else url["valueFrom"]["secretKeyRef"]


@pytest.mark.parametrize("gateway_mode, gateway_in", [(None, "vllm"), ("sidecar", "gateway"), ("inProcess", "vllm")])
def test_each_container_reads_its_own_users_url(gateway_mode: str | None, gateway_in: str) -> None:
    """Each container as its own user; the gateway's user wherever the gateway runs: its own container (sidecar), or
    the vllm container's process (inProcess, and the default on the CPU engine image)."""
    spec = SPEC if gateway_mode is None else {**SPEC, "serving": {"gatewayMode": gateway_mode}}
    ctx = RenderContext(name="demo", namespace=NS, uid=UID, cfg=parse_spec("demo", spec))
    found = containers(render_all(ctx))
    users = {"gateway": gateway_in} | {user: user for user in ("reloader", "feedback", "trainer", "rollout")}
    for user, name in users.items():  # the container is named as its user, but for the gateway in vLLM's process
        assert redis_url_ref(found[name]) == {"name": "demo-redis-urls", "key": user}, name
    assert ("gateway" in found) == (gateway_in == "gateway")
    # without the flag every container still reads the one configured key (an external Redis with one user)
    one = {"auth": {"allowAnonymous": True}, "redis": {"urlSecret": "x"}}
    single = RenderContext(name="demo", namespace=NS, uid=UID, cfg=parse_spec("demo", one))
    keys = {redis_url_ref(ct)["key"] for ct in containers(render_all(single)).values() if redis_url_ref(ct)}
    assert keys == {"url"}


@pytest.fixture
def shared(tmp_path: Path) -> Iterator[EmbeddedValkey]:
    vk = EmbeddedValkey(tmp_path / "valkey", users=RedisUsers("demo", acl.new_passwords()), durable=False).start()
    try:
        yield vk
    finally:
        vk.stop()


async def test_the_operator_reads_the_job_as_its_own_user(cluster: Cluster, shared: EmbeddedValkey) -> None:
    """The real operator (reconciler on an API emulator) finds the job's Redis through the per-user Secret and reads
    it as ``operator``: the job gets healthy, and the server saw no refused command (ACL LOG empty)."""
    urls = {c.value: shared.url_for(c) for c in Component if c is not Component.ADMIN}
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "demo-redis-urls", "namespace": NS},
        "data": {k: base64.b64encode(v.encode()).decode() for k, v in urls.items()},
    }
    await cluster.kube.create(secret)
    await cluster.apply_job("demo", SPEC)
    await wait_until(lambda: cluster.condition("demo", "Degraded").get("reason") == "Healthy", what="healthy")
    admin = redis.Redis.from_url(shared.url)
    try:
        assert admin.acl_log() == []
        clients = admin.client_list()
        assert all(c["user"] in ("admin", "operator") for c in clients), clients
    finally:
        admin.close()
