"""The gateway's cached view of the world, refreshed in the background so no request waits on Redis or vLLM.

* the policy table (Redis hash ``policy``), every ``policy_interval`` seconds;
* the versions loaded in *this replica's* vLLM (``GET /v1/models``), every ``models_interval`` seconds, and at once
  when a request finds a model missing;
* whether Redis and the engine answer, for ``/readyz`` and to fail fast with 503;
* full-weight mode: the version vLLM's one model holds, told by this pod's reloader (:class:`WeightsGate`), never
  read from Redis: a shared key cannot say what *this* vLLM holds at the moment a request is sent;
* per-project adapters (issue 39): the versions of each project line loaded here (adapters ``{job}@{project}-v{N}``
  in the model list), and those lines' policy tables, read in the same round trip as the shared one. ``lines`` holds
  only the lines a request may be routed on (:func:`routable`), so routing a key to its project's line costs one
  dict lookup on the request path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from onlinerl.config import ProjectsConfig
from onlinerl.dataplane import lines
from onlinerl.keys import SHARED_LINE, Keys
from onlinerl.lines import parse_adapter_name
from onlinerl.schemas import PolicyTable
from onlinerl_serving.routing import newest_loaded_at_most
from onlinerl_serving.upstream import Engine, EngineUnavailable
from onlinerl_serving.weights_gate import WeightsGate

log = logging.getLogger("onlinerl.gateway")


@dataclass(frozen=True)
class LineState:
    """One policy line as this replica routes it: its table and its versions loaded here (always with 0, the base)."""

    table: PolicyTable
    loaded: frozenset[int]


def parse_models(job: str, base_name: str, ids: list[str]) -> tuple[frozenset[int], dict[str, frozenset[int]]]:
    """vLLM's model ids as ``(shared line's versions, {project: its line's versions})``; 0 (the base) is in the
    shared set when the base is served. Names that are not this job's are ignored."""
    shared: set[int] = set()
    lines: dict[str, set[int]] = {}
    for model in ids:
        if model == base_name:
            shared.add(0)
            continue
        parsed = parse_adapter_name(job, model)
        if parsed is None:
            continue
        line, v = parsed
        (lines.setdefault(line, set()) if line else shared).add(v)
    return frozenset(shared), {p: frozenset(vs) for p, vs in lines.items()}


def routable(
    projects: ProjectsConfig, tables: Mapping[str, PolicyTable], loaded: Mapping[str, frozenset[int]]
) -> dict[str, LineState]:
    """The project lines a user request may be routed on: the config gives the project a line of its own, and its
    table has a stable version above 0 with it, or an older version of the line, loaded here (while a newly promoted
    stable loads, the line's users keep its previous version instead of flapping to the shared policy). A line that
    promoted nothing yet (stable 0) is routed only while it runs a canary of a version loaded here, or pins one: its
    users must reach the candidate, and its stable arm serves them what they are served now, the shared stable
    (``Gateway.pick``), counted on the line. Every other project, and one rolled back to 0, is served the shared
    policy on the shared line."""
    out = {}
    for project, versions in loaded.items():
        table = tables.get(project)
        if table is None or not projects.has_own_line(project):
            continue
        if table.stable > 0:
            routed = newest_loaded_at_most(table.stable, versions) > 0
        elif table.pinned is not None:
            routed = table.pinned in versions
        else:
            routed = table.candidate in versions and table.canary_share > 0
        if routed:
            out[project] = LineState(table, versions | {0})
    return out


class ServingState:
    def __init__(
        self,
        *,
        redis: Any,
        keys: Keys,
        engine: Engine,
        job: str,
        base_name: str,
        weights_mode: str = "lora",
        policy_interval: float = 0.5,
        models_interval: float = 1.0,
        projects: ProjectsConfig | None = None,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.engine = engine
        self.job = job
        self.base_name = base_name
        self.weights_mode = weights_mode
        self.policy_interval = policy_interval
        self.models_interval = models_interval
        self.policy = PolicyTable()
        self.loaded: frozenset[int] = frozenset()
        # Per-project adapters (off unless projects.adapters is listed/all and the weights are LoRA adapters).
        self.projects = projects or ProjectsConfig()
        self.project_lines_on = self.projects.adapters != "off" and weights_mode == "lora"
        self.line_loaded: dict[str, frozenset[int]] = {}  # project -> versions of its line loaded here
        self.line_tables: dict[str, PolicyTable] = {}  # project -> its line's policy table
        self.lines: dict[str, LineState] = {}  # project -> its line, for the projects routed on their own line
        self.weights = WeightsGate()  # full-weight mode only
        self.redis_up = False
        self.engine_up = False
        self.policy_at = 0.0
        self._tasks: list[asyncio.Task] = []

    async def refresh_policy(self) -> None:
        """The shared table and those of the project lines loaded here, in one pipelined round trip."""
        try:
            projects = sorted(self.line_loaded)
            self.policy, self.line_tables = await lines.tables_async(self.redis, self.keys.job, projects)
            self.lines = routable(self.projects, self.line_tables, self.line_loaded)
            self.redis_up = True
            self.policy_at = time.monotonic()
        except Exception as exc:
            if self.redis_up:
                log.warning("redis unavailable: %s", exc)
            self.redis_up = False
            return
        if self.behind_table():
            await self.refresh_models()

    def behind_table(self) -> bool:
        """True when the table names a version (stable, candidate or pin) that this replica's view of vLLM's models
        lacks. Routing then falls back to the newest loaded version at most it, so a just-promoted version would wait
        for the next models poll (up to ``models_interval``) before its users get it; asking vLLM at once closes that
        window. The reloader loads a version on every replica before the table may name it as stable, so this is
        usually one extra ``/v1/models`` call per switch (at most one per policy refresh while a replica lags)."""
        if self.weights_mode != "lora":
            return False
        named = {self.policy.stable, self.policy.candidate, self.policy.pinned} - {None, 0}
        return not named <= self.loaded

    async def refresh_models(self) -> None:
        try:
            status, body = await asyncio.wait_for(self.engine.get_bytes("/v1/models"), 2.0)
            if status != 200:
                raise EngineUnavailable(f"GET /v1/models answered {status}")
            ids = [m.get("id", "") for m in orjson.loads(body).get("data", ())]
            self.loaded, line_loaded = parse_models(self.job, self.base_name, ids)
            if self.project_lines_on:
                self.line_loaded = {p: vs for p, vs in line_loaded.items() if self.projects.has_own_line(p)}
                self.lines = routable(self.projects, self.line_tables, self.line_loaded)
            self.engine_up = 0 in self.loaded
        except Exception as exc:
            if self.engine_up:
                log.warning("engine unavailable: %s", exc)
            self.engine_up = False

    def loaded_versions(self) -> frozenset[int]:
        if self.weights_mode == "full":
            return frozenset() if self.weights.version is None else frozenset({self.weights.version})
        return self.loaded

    def line_versions(self, line: str) -> frozenset[int]:
        """Versions of ``line`` loaded here, the base (0) included: what an evaluation may ask for on that line."""
        if line == SHARED_LINE:
            return frozenset({0, *self.loaded_versions()})
        return frozenset({0, *self.line_loaded.get(line, ())})

    async def _loop(self, fn: Any, interval: float) -> None:
        while True:
            await fn()
            await asyncio.sleep(interval)

    async def start(self) -> None:
        await asyncio.gather(self.refresh_policy(), self.refresh_models())
        self._tasks = [
            asyncio.create_task(self._loop(self.refresh_policy, self.policy_interval)),
            asyncio.create_task(self._loop(self.refresh_models, self.models_interval)),
        ]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
