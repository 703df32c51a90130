"""The reconcile's steps against API faults, and server-side apply's exact requests (kmock records every request).

kmock merges every PATCH whatever its content type, so what server-side apply removes cannot be seen in its stored
objects: the removal is asserted on the exact request the operator sent (content type, field manager, body).
"""

from __future__ import annotations

import base64
from typing import Any

import pytest

from tests.operator.conftest import NS, Cluster, wait_until

pytestmark = pytest.mark.timeout(90)

INGRESSES = "networking.k8s.io/v1/ingresses"


def base_spec(url: str, **sections: Any) -> dict[str, Any]:
    return {"auth": {"allowAnonymous": True}, "redis": {"url": url}, **sections}


def applies(cluster: Cluster, resource: str, name: str) -> list[Any]:
    """Every server-side apply request the operator sent for one object, in order."""
    return [
        r
        for r in cluster.kmock
        if r.method.value == "PATCH"
        and r.resource == resource
        and r.name == name
        and r.headers.get("Content-Type") == "application/apply-patch+yaml"
    ]


async def test_clearing_an_optional_field_removes_it_from_the_applied_manifest(cluster: Cluster, empty_valkey) -> None:
    spec = base_spec(empty_valkey.url, ingress={"enabled": True, "host": "rl.example.com", "tlsSecret": "rl-tls"})
    await cluster.apply_job("demo", spec)
    await wait_until(lambda: cluster.obj("Ingress", "demo"), what="ingress")
    generation = await cluster.patch_spec("demo", {"serving": {"replicas": 2}})
    await wait_until(lambda: cluster.status("demo").get("observedGeneration") == generation, what="second pass")
    first = applies(cluster, INGRESSES, "demo")
    assert first, "the operator never server-side applied the Ingress"
    assert first[-1].data["spec"]["tls"] == [{"hosts": ["rl.example.com"], "secretName": "rl-tls"}]

    generation = await cluster.patch_spec("demo", {"ingress": {"tlsSecret": ""}})
    await wait_until(lambda: cluster.status("demo").get("observedGeneration") == generation, what="tls cleared")
    request = applies(cluster, INGRESSES, "demo")[-1]
    assert request.params.get("fieldManager") == "onlinerl-operator"
    assert request.params.get("force") == "true"
    assert request.data["kind"] == "Ingress" and request.data["metadata"]["name"] == "demo"
    # The whole desired object, without `tls`: the API server drops the field this manager no longer applies.
    assert "tls" not in request.data["spec"], request.data["spec"]
    assert request.data["spec"]["rules"][0]["host"] == "rl.example.com"


def inject(cluster: Cluster, method: str, resource: str, name: str, status: int, times: int) -> list[int]:
    """Answer the next ``times`` matching requests with ``status`` (a kmock reaction); returns the ids it hit."""
    hit: list[int] = []
    after = max((r.id for r in cluster.kmock), default=-1)  # kmock also runs criteria over past requests

    def matches(request: Any) -> bool:
        if request.id in hit:
            return True
        if request.id <= after or len(hit) >= times:
            return False
        named = request.name or ((request.data or {}).get("metadata") or {}).get("name")  # a POST names it in its body
        if request.method.value == method and request.resource == resource and named == name:
            hit.append(request.id)
            return True
        return False

    cluster.kmock[matches] << status << {"kind": "Status", "code": status, "message": f"injected {status}"}
    return hit


# One fault site per step: the request that step makes.
STEPS = {
    "children": ("PATCH", "apps/v1/deployments", "demo-serving"),
    "trainer": ("GET", "batch/v1/jobs", "demo-trainer"),
    "components": ("GET", "apps/v1/deployments", "demo-feedback"),
    "data plane": ("GET", "v1/secrets", "demo-redis-url"),
}
REASONS = {403: "ApiForbidden", 409: "ApiConflict", 422: "ApiInvalid", 500: "ApiUnavailable"}


@pytest.mark.parametrize("code", sorted(REASONS))
@pytest.mark.parametrize("step", list(STEPS))
async def test_a_refused_step_is_a_typed_condition_then_retried(
    cluster: Cluster, empty_valkey, step: str, code: int
) -> None:
    """The job runs; then the API refuses the request one step makes, twice. The refusal shows as the typed reason of
    the Degraded condition, naming the step; the step is retried after its kind's delay (RetryPolicy) and the job
    recovers."""
    # The data-plane step reads the Redis URL from a Secret through the API (redis.urlSecret).
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "demo-redis-url", "namespace": NS},
        "data": {"url": base64.b64encode(empty_valkey.url.encode()).decode()},
    }
    await cluster.kube.create(secret)
    await cluster.apply_job("demo", {"auth": {"allowAnonymous": True}, "redis": {"urlSecret": "demo-redis-url"}})
    await wait_until(lambda: cluster.status("demo").get("observedGeneration") == 1, what="first pass")
    await wait_until(lambda: cluster.condition("demo", "Degraded").get("reason") == "Healthy", what="healthy")

    method, resource, name = STEPS[step]
    hit = inject(cluster, method, resource, name, code, times=2)
    if step == "children":
        await cluster.patch_spec("demo", {"serving": {"replicas": 2}})  # children are applied on spec changes only
    degraded = await wait_until(
        lambda: (d := cluster.condition("demo", "Degraded")).get("reason") == REASONS[code] and d,
        what=f"Degraded/{REASONS[code]} after {code} in step {step}",
    )
    assert degraded["status"] == "True" and degraded["message"].startswith(f"{step}: "), degraded
    assert cluster.status("demo")["phase"] == "Degraded"

    # Every refusal is retried, and the job recovers once the API answers again.
    await wait_until(
        lambda: cluster.condition("demo", "Degraded").get("reason") == "Healthy",
        what=f"recovery after {code} in step {step}",
        timeout=20,
    )
    assert len(hit) == 2, f"the fault was hit {len(hit)} times: the step was not retried"
    assert cluster.obj("Deployment", "demo-serving") is not None
    # A spec change replaces the trainer Job (its template is immutable): wait for the new one.
    await wait_until(lambda: cluster.obj("Job", "demo-trainer"), what="trainer Job")
