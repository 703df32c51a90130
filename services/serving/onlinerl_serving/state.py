"""The gateway's cached view of the world, refreshed in the background so no request waits on Redis or vLLM.

* the policy table (Redis hash ``policy``), every ``policy_interval`` seconds;
* the versions loaded in *this replica's* vLLM (``GET /v1/models``), every ``models_interval`` seconds, and at once
  when a request finds a model missing;
* whether Redis and the engine answer, for ``/readyz`` and to fail fast with 503;
* full-weight mode: the version vLLM's one model holds, told by this pod's reloader (:class:`WeightsGate`), never
  read from Redis: a shared key cannot say what *this* vLLM holds at the moment a request is sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import orjson

from onlinerl.dataplane import policy as policy_table
from onlinerl.keys import Keys
from onlinerl.schemas import PolicyTable
from onlinerl_serving.routing import version_of_model
from onlinerl_serving.upstream import EnginePool, EngineUnavailable
from onlinerl_serving.weights_gate import WeightsGate

log = logging.getLogger("onlinerl.gateway")


class ServingState:
    def __init__(
        self,
        *,
        redis: Any,
        keys: Keys,
        engine: EnginePool,
        job: str,
        base_name: str,
        weights_mode: str = "lora",
        policy_interval: float = 0.5,
        models_interval: float = 1.0,
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
        self.weights = WeightsGate()  # full-weight mode only
        self.redis_up = False
        self.engine_up = False
        self.policy_at = 0.0
        self._tasks: list[asyncio.Task] = []

    async def refresh_policy(self) -> None:
        try:
            self.policy = await policy_table.read_async(self.redis, self.keys)
            self.redis_up = True
            self.policy_at = time.monotonic()
        except Exception as exc:
            if self.redis_up:
                log.warning("redis unavailable: %s", exc)
            self.redis_up = False

    async def refresh_models(self) -> None:
        try:
            status, body = await asyncio.wait_for(self.engine.get_bytes("/v1/models"), 2.0)
            if status != 200:
                raise EngineUnavailable(f"GET /v1/models answered {status}")
            versions = set()
            for m in orjson.loads(body).get("data", ()):
                v = version_of_model(self.job, self.base_name, m.get("id", ""))
                if v is not None:
                    versions.add(v)
            self.loaded = frozenset(versions)
            self.engine_up = 0 in versions
        except Exception as exc:
            if self.engine_up:
                log.warning("engine unavailable: %s", exc)
            self.engine_up = False

    def loaded_versions(self) -> frozenset[int]:
        if self.weights_mode == "full":
            return frozenset() if self.weights.version is None else frozenset({self.weights.version})
        return self.loaded

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
