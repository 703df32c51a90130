"""Two lanes for ``make test`` on pytest-xdist: every vLLM test on the engine worker, the rest spread over all workers.

Why: a serial run left half of a 2-core machine idle (15.5 CPU-minutes used of 30): the vLLM tests wait on their
engines and the CPU-light tests wait on timers, sockets and subprocesses. Running them side by side fills the idle
half. But the vLLM tests must stay in one process: the shared engines (tests/engines.py) live in the worker that
booted them, modules hand an engine on to the next one in order, and two workers booting engines would compile them
twice on the same two cores.

So the scheduler below gives the whole vLLM lane (the workers name its tests: :func:`write_lane`) to the engine
worker, ``gw0``, which boots the shared engines at collection. Every other
module is one work unit handed to whichever worker runs low, ``gw0`` included once its vLLM lane is done. A module's
tests stay together on one worker, so module fixtures start once.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from xdist.scheduler import LoadScopeScheduling
from xdist.workermanage import WorkerController

from tests.engines import PLAN

VLLM_GROUP = "vllm"
ENGINE_WORKER = "gw0"


def engine_worker() -> bool:
    """True in the process that runs the vLLM lane: ``gw0`` under xdist, the only process without it."""
    return os.environ.get("PYTEST_XDIST_WORKER", ENGINE_WORKER) == ENGINE_WORKER


FILLER_NICENESS = 5


def yield_to_the_engine_lane() -> None:
    """Every worker but the engine worker runs at a lower CPU priority (``nice`` +5), with what it starts.

    Why: the vLLM lane is the run's critical path (507 of 533 s, 2 cores, 2026-12-06), and the other workers' modules
    are fillers that can take whatever CPU the lane's engines and gateways leave. At equal priority they took it from
    the lane instead, so the lane ended last, alone, while the fillers had finished a minute earlier."""
    if os.environ.get("PYTEST_XDIST_WORKER", ENGINE_WORKER) != ENGINE_WORKER:
        os.nice(FILLER_NICENESS)


def needs_vllm(item: pytest.Item) -> bool:
    return item.get_closest_marker("vllm") is not None or any(f in PLAN for f in item.fixturenames)


def write_lane(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tell the scheduler which tests form the vLLM lane. It runs in the controller, which sees only node ids, so each
    worker writes the lane's ids next to its own temp folder once collection is final (selection and order applied),
    before it reports its collection. (xdist's own ``xdist_group`` suffix cannot carry it: pytest 9 ignores it.)"""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return
    lane = [item.nodeid for item in items if needs_vllm(item) or item.get_closest_marker("engine_plan_guard")]
    path = lane_file(config._tmp_path_factory.getbasetemp().parent)  # type: ignore[attr-defined]
    tmp = path.with_name(f"{path.name}.{os.environ['PYTEST_XDIST_WORKER']}")
    tmp.write_text(json.dumps(lane))
    tmp.replace(path)  # every worker writes the same list: the last rename wins, whole


def lane_file(root: Path) -> Path:
    return root / "vllm-lane.json"


def worker_port_range(lo: int, hi: int) -> tuple[int, int]:
    """This worker's slice of ``lo..hi`` for loopback ports: workers choose ports independently, and a port one
    chose but has not bound yet (a server still starting) must not be chosen by another."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if worker is None or count <= 1:
        return lo, hi
    index = int(worker.removeprefix("gw"))
    width = (hi - lo + 1) // count
    return lo + index * width, lo + (index + 1) * width - 1


class EngineLaneScheduling(LoadScopeScheduling):
    """:class:`LoadScopeScheduling` (a module is a work unit) with one unit more, the vLLM lane, which goes to the
    engine worker, first."""

    _lane: frozenset[str] | None = None

    def _split_scope(self, nodeid: str) -> str:
        if self._lane is None:
            self._lane = frozenset(json.loads(lane_file(self.config._tmp_path_factory.getbasetemp()).read_text()))
        return VLLM_GROUP if nodeid in self._lane else nodeid.split("::", 1)[0]

    def _assign_work_unit(self, node: WorkerController) -> None:
        scope = self._next_scope_for(node)
        if scope is None:
            return
        work_unit = self.workqueue.pop(scope)
        self.assigned_work.setdefault(node, {})[scope] = work_unit
        collection = self.registered_collections[node]
        node.send_runtest_some([collection.index(nodeid) for nodeid, done in work_unit.items() if not done])

    def _next_scope_for(self, node: WorkerController) -> str | None:
        """The engine worker takes the vLLM lane before anything else; every worker takes the other units in
        collection order. The vLLM lane goes elsewhere only when no engine worker is left (it crashed)."""
        is_engine_worker = node.gateway.id == ENGINE_WORKER
        if VLLM_GROUP in self.workqueue and (is_engine_worker or not self._engine_worker_alive()):
            return VLLM_GROUP
        for scope in self.workqueue:
            if scope != VLLM_GROUP:
                return scope
        return None

    def _engine_worker_alive(self) -> bool:
        return any(node.gateway.id == ENGINE_WORKER for node in self.assigned_work)

    def _reschedule(self, node: WorkerController) -> None:
        """As the base class, except that a worker with nothing it may take shuts down instead of waiting."""
        if node.shutting_down:
            return
        pending = self._pending_of(self.assigned_work[node])
        if not self.workqueue or (self._next_scope_for(node) is None and not pending):
            node.shutdown()
            return
        if pending > 2:
            return
        self._assign_work_unit(node)
