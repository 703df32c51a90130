"""kopf against kmock (a stateful Kubernetes API emulator) with the real operator handlers and a real valkey.

kmock does not stamp uid/generation/resourceVersion: the tests stamp uid and generation themselves, the way the API
server would (generation += 1 on every spec change).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import kopf
import pytest

from onlinerl_operator import constants as c
from onlinerl_operator.handlers import build_registry
from onlinerl_operator.kube import KINDS, Kube
from onlinerl_operator.reconcile import RetryPolicy
from tests.operator import kmock_match

kmock_match.install()  # kmock's request matching without its quadratic history scan (tests/operator/kmock_match.py)

NS = "team-a"
CR_RESOURCE = f"{c.GROUP}/{c.VERSION}/{c.PLURAL}"
INTERVAL = 0.2
# The production delays (60 s for a 403) scaled down: a test sees the retry follow within its timeout.
RETRY = RetryPolicy(forbidden=0.6, invalid=0.8, conflict=0.2, unavailable=0.3)


async def wait_until(predicate: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    """Poll an (a)sync predicate until truthy; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if asyncio.iscoroutine(last):
            last = await last
        if last:
            return last
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


@dataclass
class Cluster:
    """The emulated API server plus helpers that act like kubectl and the built-in controllers."""

    kmock: Any
    kube: Kube

    def _entry(self, kind: str, name: str) -> Any:
        prefix, plural = KINDS[kind]
        wanted = prefix.removeprefix("/apis/").removeprefix("/api/") + f"/{plural}"
        for (resource, namespace, obj_name), entry in self.kmock.objects.items():
            if resource == wanted and namespace == NS and obj_name == name:
                return entry
        return None

    def obj(self, kind: str, name: str) -> dict[str, Any] | None:
        """The object as stored now (None if absent or deleted)."""
        entry = self._entry(kind, name)
        return None if entry is None or entry.deleted else entry.raw

    def creations(self, kind: str, name: str) -> int:
        """How many times the object was created (a recreated Job counts twice): versions after a deletion mark."""
        entry = self._entry(kind, name)
        if entry is None:
            return 0
        history = list(entry.history)
        return sum(1 for i, v in enumerate(history) if v is not None and (i == 0 or history[i - 1] is None))

    def job(self, name: str) -> dict[str, Any] | None:
        return self.obj("OnlineRLJob", name)

    async def apply_job(self, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        """kubectl apply of a new OnlineRLJob: the API server stamps uid, generation and creationTimestamp."""
        body = {
            "apiVersion": c.API_VERSION,
            "kind": c.KIND,
            "metadata": {
                "name": name,
                "namespace": NS,
                "uid": str(uuid.uuid4()),
                "generation": 1,
                "resourceVersion": "1",
                "creationTimestamp": "2026-11-20T10:00:00Z",
            },
            "spec": spec,
        }
        created = await self.kube.create(body)
        assert created is not None
        return body

    async def patch_spec(self, name: str, spec_patch: dict[str, Any]) -> int:
        generation = self.job(name)["metadata"]["generation"] + 1
        await self.kube.patch("OnlineRLJob", NS, name, {"spec": spec_patch, "metadata": {"generation": generation}})
        return generation

    async def set_status(self, kind: str, name: str, status: dict[str, Any]) -> None:
        """What a built-in controller (Deployment, Job) would report."""
        await self.kube.patch(kind, NS, name, {"status": status}, subresource="status")

    async def delete_job(self, name: str) -> None:
        """kubectl delete: the API server marks it (finalizers) and removes it once they are gone."""
        assert await self.kube.delete("OnlineRLJob", NS, name)

    def status(self, name: str) -> dict[str, Any]:
        return (self.job(name) or {}).get("status") or {}

    def condition(self, name: str, ctype: str) -> dict[str, Any]:
        return next((cd for cd in self.status(name).get("conditions", []) if cd["type"] == ctype), {})

    def status_patches(self) -> list[dict[str, Any]]:
        """Every status the operator wrote to any OnlineRLJob (request bodies, in order)."""
        return [
            r.data["status"]
            for r in self.kmock
            if r.subresource == "status" and r.resource == CR_RESOURCE and r.data and "status" in r.data
        ]

    async def make_ready(self, name: str) -> None:
        for component in ("serving", "feedback"):
            dep = self.obj("Deployment", f"{name}-{component}")
            await self.set_status("Deployment", f"{name}-{component}", {"readyReplicas": dep["spec"]["replicas"]})
        await self.set_status("Job", f"{name}-trainer", {"active": 1, "ready": 1})


@pytest.fixture
async def cluster(kmock: Any, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Cluster]:
    """kopf running our handlers against kmock, watching namespace NS.

    kopf runs in its own thread and event loop, as in production: on exit kopf cancels every task of its loop that
    it did not start with, which would include kmock's own server tasks if they shared one loop.
    """
    kmock.resources[CR_RESOURCE] = kmock.ResourceInfo(
        kind=c.KIND,
        singular=c.SINGULAR,
        namespaced=True,
        subresources={"status"},
        verbs={"list", "watch", "get", "create", "patch", "delete"},
        shortnames=set(c.SHORT_NAMES),
    )
    # kopf's backbone waits for these core resources in discovery before it starts any watch.
    kmock.resources["v1/namespaces"] = kmock.ResourceInfo(kind="Namespace", namespaced=False, verbs={"list", "watch"})
    kmock.resources["v1/events"] = kmock.ResourceInfo(kind="Event", namespaced=True, verbs={"create"})
    kmock.resources["apiextensions.k8s.io/v1/customresourcedefinitions"] = kmock.ResourceInfo(
        kind="CustomResourceDefinition", namespaced=False, verbs={"list", "watch"}
    )
    _stamp_resource_versions(kmock, monkeypatch)
    url = str(kmock.url).rstrip("/")
    registry = build_registry(interval=INTERVAL, retry=RETRY)

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(server=url)

    cleaned = threading.Event()
    kopf_loop: list[asyncio.AbstractEventLoop] = []

    @kopf.on.cleanup(registry=registry)
    async def cleaned_up(**_: Any) -> None:  # kopf runs cleanup activities once its root tasks have stopped
        kopf_loop.append(asyncio.get_running_loop())
        cleaned.set()

    settings = kopf.OperatorSettings()
    settings.scanning.disabled = True
    settings.batching.idle_timeout = 0.5
    memo = kopf.Memo(kube_factory=lambda: Kube.for_host(url), locks={})
    stop, ready = threading.Event(), threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(
                kopf.operator(
                    registry=registry,
                    settings=settings,
                    memo=memo,
                    namespaces=[NS],
                    standalone=True,
                    stop_flag=stop,
                    ready_flag=ready,
                )
            )
        except asyncio.CancelledError as exc:  # kopf re-raises a straggler's cancellation: ours, at teardown
            if not cleaned.is_set():
                failure.append(exc)
        except BaseException as exc:  # surfaced by the fixture
            failure.append(exc)

    thread = threading.Thread(target=run, name="kopf", daemon=True)
    thread.start()
    test_kube = Kube.for_host(url)
    try:
        await wait_until(lambda: ready.is_set() or failure, timeout=15, what="kopf ready")
        assert not failure, failure
        yield Cluster(kmock=kmock, kube=test_kube)
    finally:
        stop.set()
        await wait_until(lambda: cleaned.is_set() or not thread.is_alive(), timeout=15, what="kopf's cleanup")
        if kopf_loop and thread.is_alive():
            # kopf gives tasks still running after its root tasks 5 s before it cancels them: a timer spawned by a
            # watch event that raced the daemon killer's exit sleeps out its retry. Nothing is left to wait for.
            with contextlib.suppress(RuntimeError):  # the loop closed since the check: kopf ended on its own
                kopf_loop[0].call_soon_threadsafe(_cancel_all_but_the_operator, kopf_loop[0])
        await wait_until(lambda: not thread.is_alive(), timeout=15, what="kopf stopped")
        await test_kube.close()
        assert not failure, failure


def _stamp_resource_versions(kmock: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Give every write a new metadata.resourceVersion, as the API server does; kmock keeps whatever it was sent.

    kopf relies on it: after patching its progress it ignores watch events older than the version its patch returned.
    With one constant version, an event queued before the patch looked current, kopf saw no record of the handler it
    had just run and ran it again: spec_changed ran about 13 times for 4 spec changes in test_operator's pin test,
    which took 18 s alone and up to 135 s beside other tests. Only creations and merge patches of the object itself
    get one: a status write keeping the version lets kopf's JSON patches (finalizers), which test the version they
    read, pass as they would on a server that answers a failed test with a conflict kopf re-reads on, where kmock
    answers 500 and kopf repeats the same patch. (kmock's emulator is a slotted class: the method is replaced on the
    class, for this test only.)
    """
    versions = itertools.count(2)
    emulator = type(kmock)
    handle = emulator._handle

    async def stamped(self: Any, request: Any) -> Any:
        writes = request.action in (kmock.action.CREATE, kmock.action.UPDATE) and not request.subresource
        if request.resource is not None and writes and isinstance(request.data, dict):
            request.data.setdefault("metadata", {})["resourceVersion"] = str(next(versions))
        return await handle(self, request)

    monkeypatch.setattr(emulator, "_handle", stamped)


def _cancel_all_but_the_operator(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel every task of kopf's loop but the one running ``kopf.operator`` (asyncio.run's main task)."""
    current = {t for t in asyncio.all_tasks(loop) if t.get_coro().__qualname__.startswith("operator")}
    for task in asyncio.all_tasks(loop) - current:
        task.cancel()
