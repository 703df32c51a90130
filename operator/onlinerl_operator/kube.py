"""A small async Kubernetes client for arbitrary kinds (on kubernetes_asyncio's ApiClient: auth, TLS, kubeconfig).

The reconciler deals in whole manifests, so one generic server-side apply beats a dozen typed APIs. Async all the
way: a blocking client inside kopf's event loop would stall every other handler (and deadlock an in-process mock).

Children are written with **server-side apply** under one field manager (:data:`FIELD_MANAGER`): the API server then
removes a field that left the desired manifest (a JSON merge patch never does: clearing ``ingress.tlsSecret`` would
leave ``spec.tls`` behind), and fields other managers own (an HPA's ``replicas``, a mutating webhook's) are left alone.
"""

from __future__ import annotations

import json
from typing import Any

from kubernetes_asyncio import client as k8s
from kubernetes_asyncio import config as k8s_config

# kind -> (API path prefix, plural). Only what the operator creates or reads.
KINDS: dict[str, tuple[str, str]] = {
    "ConfigMap": ("/api/v1", "configmaps"),
    "Secret": ("/api/v1", "secrets"),
    "Service": ("/api/v1", "services"),
    "PersistentVolumeClaim": ("/api/v1", "persistentvolumeclaims"),
    "Deployment": ("/apis/apps/v1", "deployments"),
    "StatefulSet": ("/apis/apps/v1", "statefulsets"),
    "Job": ("/apis/batch/v1", "jobs"),
    "Ingress": ("/apis/networking.k8s.io/v1", "ingresses"),
    "NetworkPolicy": ("/apis/networking.k8s.io/v1", "networkpolicies"),
    "ServiceMonitor": ("/apis/monitoring.coreos.com/v1", "servicemonitors"),
    "PodMonitor": ("/apis/monitoring.coreos.com/v1", "podmonitors"),
    "HorizontalPodAutoscaler": ("/apis/autoscaling/v2", "horizontalpodautoscalers"),
    "PodDisruptionBudget": ("/apis/policy/v1", "poddisruptionbudgets"),
    "ScaledObject": ("/apis/keda.sh/v1alpha1", "scaledobjects"),
    "JobSet": ("/apis/jobset.x-k8s.io/v1alpha2", "jobsets"),
    "OnlineRLJob": ("/apis/onlinerl.dev/v1alpha1", "onlinerljobs"),
    "Event": ("/api/v1", "events"),
}
MONITORING_API = "/apis/monitoring.coreos.com/v1"
FIELD_MANAGER = "onlinerl-operator"
APPLY_CONTENT_TYPE = "application/apply-patch+yaml"  # JSON is YAML: the body is sent as JSON


class KubeError(RuntimeError):
    def __init__(self, status: int, method: str, path: str, body: Any) -> None:
        message = body.get("message") if isinstance(body, dict) else str(body)[:500]
        super().__init__(f"{method} {path}: HTTP {status}: {message}")
        self.status = status


def object_path(kind: str, namespace: str, name: str | None = None) -> str:
    prefix, plural = KINDS[kind]
    path = f"{prefix}/namespaces/{namespace}/{plural}"
    return f"{path}/{name}" if name else path


class Kube:
    """Apply (server-side), create, merge-patch (status, one-field changes), get, list and delete by kind."""

    def __init__(self, api: k8s.ApiClient) -> None:
        self.api = api

    @classmethod
    def for_host(cls, host: str) -> Kube:
        """An unauthenticated client (tests against an API emulator)."""
        configuration = k8s.Configuration(host=host.rstrip("/"))
        return cls(k8s.ApiClient(configuration))

    @classmethod
    async def from_environment(cls) -> Kube:
        """In a pod: the service account; elsewhere: the current kubeconfig context."""
        try:
            k8s_config.load_incluster_config()
        except k8s_config.ConfigException:
            await k8s_config.load_kube_config()
        return cls(k8s.ApiClient())

    async def close(self) -> None:
        await self.api.close()

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        content_type: str | None = None,
        query: list[tuple[str, str]] | None = None,
    ) -> tuple[int, Any]:
        headers = {"Accept": "application/json"}
        if content_type:
            headers["Content-Type"] = content_type
        resp = await self.api.call_api(
            path,
            method,
            header_params=headers,
            body=body,
            query_params=query or [],
            auth_settings=["BearerToken"],
            _preload_content=False,
        )
        try:
            text = await resp.text()
        finally:
            resp.release()
        try:
            data = json.loads(text) if text else None
        except json.JSONDecodeError:
            data = text
        return resp.status, data

    async def _checked(self, method: str, path: str, **kw: Any) -> Any:
        status, data = await self.request(method, path, **kw)
        if not 200 <= status < 300:
            raise KubeError(status, method, path, data)
        return data

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        status, data = await self.request("GET", object_path(kind, namespace, name))
        if status == 404:
            return None
        if not 200 <= status < 300:
            raise KubeError(status, "GET", object_path(kind, namespace, name), data)
        return data

    async def create(self, manifest: dict[str, Any]) -> dict[str, Any] | None:
        """POST; None when it already exists (409)."""
        ns = manifest["metadata"]["namespace"]
        status, data = await self.request("POST", object_path(manifest["kind"], ns), body=manifest)
        if status == 409:
            return None
        if not 200 <= status < 300:
            raise KubeError(status, "POST", object_path(manifest["kind"], ns), data)
        return data

    async def patch(
        self, kind: str, namespace: str, name: str, patch: dict[str, Any], subresource: str = ""
    ) -> dict[str, Any]:
        path = object_path(kind, namespace, name) + (f"/{subresource}" if subresource else "")
        return await self._checked("PATCH", path, body=patch, content_type="application/merge-patch+json")

    async def apply(self, manifest: dict[str, Any]) -> str:
        """Server-side apply of the whole desired manifest as :data:`FIELD_MANAGER` (``force``: this operator owns
        its children's fields; a conflicting manager loses them). Returns ``applied``, or ``created`` when the server
        answered 404 for an absent object: a real API server creates on apply, an emulator without server-side apply
        (kmock, in tests) does not, and then the object is created with POST."""
        meta = manifest["metadata"]
        path = object_path(manifest["kind"], meta["namespace"], meta["name"])
        query = [("fieldManager", FIELD_MANAGER), ("force", "true")]
        status, data = await self.request("PATCH", path, body=manifest, content_type=APPLY_CONTENT_TYPE, query=query)
        if status == 404:
            if await self.create(manifest) is not None:
                return "created"
            status, data = await self.request(
                "PATCH", path, body=manifest, content_type=APPLY_CONTENT_TYPE, query=query
            )
        if not 200 <= status < 300:
            raise KubeError(status, "PATCH", path, data)
        return "applied"

    async def list_labelled(self, kind: str, namespace: str, labels: dict[str, str]) -> list[dict[str, Any]]:
        """Objects of ``kind`` carrying every one of ``labels``. The selector goes to the server and is checked again
        here, so a server that ignores ``labelSelector`` (an emulator) can never widen what the caller deletes."""
        selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        path = object_path(kind, namespace)
        status, data = await self.request("GET", path, query=[("labelSelector", selector)])
        if status == 404:
            return []  # the kind is not served here: nothing of it to find
        if not 200 <= status < 300:
            raise KubeError(status, "GET", path, data)
        items = (data or {}).get("items") or []
        return [
            item
            for item in items
            if all(((item.get("metadata") or {}).get("labels") or {}).get(k) == v for k, v in labels.items())
        ]

    async def delete(self, kind: str, namespace: str, name: str, propagation: str = "Background") -> bool:
        """DELETE; False when it was already gone. ``Foreground``: the object stays (with a deletionTimestamp) until
        its dependents, e.g. a Job's pods, are gone."""
        path = object_path(kind, namespace, name)
        status, data = await self.request(
            "DELETE", path, body={"propagationPolicy": propagation}, content_type="application/json"
        )
        if status == 404:
            return False
        if not 200 <= status < 300:
            raise KubeError(status, "DELETE", path, data)
        return True

    async def api_served(self, group_version_path: str = MONITORING_API) -> bool:
        """Whether an API group/version is served (e.g. the Prometheus operator's monitoring.coreos.com/v1)."""
        status, _ = await self.request("GET", group_version_path)
        return 200 <= status < 300
