"""Shared vLLM engines for the test session: started once per configuration, in the background, through the product's
own launch path (:func:`onlinerl_serving.engine.start_vllm`).

Why: a vLLM-CPU start costs 25-40 s of CPU and its stop 5-15 s; twenty of them were half of ``make test``. Most vLLM
tests need only "an engine with LoRA on the tiny model": the gateway clamps every request to its own configured
``model.maxModelLen``, so jobs with shorter limits share an engine started with the longest one. Each module that uses
a shared engine runs its own job name (adapter names are ``{job}-v{N}``) and gives the engine back with only the base
model loaded (:func:`released`).

The plan (:data:`PLAN`, :data:`OWN_ENGINES`) is the budget: a module that starts an engine of its own must be listed
with its count, and :func:`start_own_engine` refuses one more (the guard in tests/test_engine_plan.py also checks that
no test calls ``start_vllm`` directly). Tests that exercise the engine's own launch, restart or several replicas keep
their own engines.

Boot overlaps with work: ``pytest_collection_modifyitems`` (tests/conftest.py) moves every module that needs vLLM to
the end and starts the engines those modules use in a background thread, so they are up by the time the CPU-light
tests are done. A run that selects no vLLM test starts no engine.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis

from onlinerl import compile_cache
from onlinerl.config import OnlineRLConfig, from_mapping
from onlinerl.procs import Child, wait_for
from onlinerl.valkey import free_port

REPO = Path(__file__).resolve().parent.parent
BASE_NAME = "onlinerl-base"  # model.servedName's default: every test job serves the base under it
PROBE = "def fibonacci(n):\n    "


@dataclass(frozen=True)
class EngineSpec:
    """One engine configuration: what decides the vLLM command line besides the port."""

    fixture: str  # the session fixture that hands it out (tests/conftest.py)
    model: str  # "tiny" | "smollm2"
    weights_mode: str  # "lora" | "full"
    max_model_len: int

    def config(self, model_path: Path) -> OnlineRLConfig:
        return from_mapping(
            {
                "job": f"shared-{self.fixture.replace('_', '-')}",
                "model": {"path": str(model_path), "maxModelLen": self.max_model_len},
                "serving": {"weightsMode": self.weights_mode},
                "trainer": {"weights": self.weights_mode},
            }
        )


# The shared engines, by the fixture that hands each out. maxModelLen is the longest any sharing job configures.
PLAN: dict[str, EngineSpec] = {
    spec.fixture: spec
    for spec in (
        EngineSpec("tiny_lora_engine", "tiny", "lora", 2048),
        EngineSpec("tiny_full_engine", "tiny", "full", 1024),
        EngineSpec("smollm2_engine", "smollm2", "lora", 1024),
    )
}

# Modules that start engines of their own, and how many each may start: they test the local stack's own launch
# path (`onlinerl up`: `python -m onlinerl_serving.engine` per replica) or several replicas.
OWN_ENGINES: dict[str, int] = {
    "tests/loop/test_replicas_e2e.py": 2,  # two replicas behind the balancer
    "tests/loop/test_up_safe_defaults.py": 1,  # the `onlinerl up` command itself, as a newcomer runs it
}
# Modules that stop a shared engine and start it again (what survives a vLLM restart), and how often.
RESTARTS: dict[str, int] = {
    "tests/serving/test_rollback_sticks.py": 1,  # a rollback survives a vLLM restart (LoRA)
    "tests/serving/test_full_weights.py": 1,  # the table survives a vLLM restart (full weights)
}


@dataclass
class SharedEngine:
    """A running shared engine: its URL and the model folder it serves."""

    spec: EngineSpec
    model_path: Path
    port: int
    child: Child
    base_text: str = ""  # the base model's greedy answer to PROBE, read at warm-up: full-weight mode's "only the base"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def models(self) -> set[str]:
        return {m["id"] for m in httpx.get(f"{self.url}/v1/models", timeout=30).json()["data"]}

    def greedy(self) -> str:
        """The served base model's greedy answer to PROBE (deterministic for the same weights)."""
        body = {"model": BASE_NAME, "prompt": PROBE, "max_tokens": 8, "temperature": 0.0}
        resp = httpx.post(f"{self.url}/v1/completions", json=body, timeout=300)
        resp.raise_for_status()
        return resp.json()["choices"][0]["text"]

    def publish_kernels(self) -> int:
        """Offer what this engine compiled so far to the engines that start after it (onlinerl/compile_cache.py)."""
        return compile_cache.publish(self.child.log_path.parent / f"torchinductor-{self.port}")

    def stop(self) -> None:
        """Stop the engine (a test of what survives a vLLM restart); :meth:`start_again` brings it back."""
        self.child.stop(timeout=5)

    def start_again(self, test_file: str) -> Child:
        """Start the stopped engine again, same configuration, port and log, through the same launch path. Counted
        against the caller's :data:`RESTARTS` budget (``test_file``: its ``__file__``)."""
        from onlinerl_serving.engine import start_vllm

        _spend(RESTARTS, restarts, test_file, "restarts the shared engine")
        assert not self.child.alive(), "start_again needs a stopped engine"
        self.child = start_vllm(self.spec.config(self.model_path), self.model_path, self.child.log_path, port=self.port)
        return self.child

    def holds_only_the_base(self) -> bool:
        if self.spec.weights_mode == "full":
            return self.greedy() == self.base_text
        return self.models() == {BASE_NAME}


@dataclass
class EnginePool:
    """Starts the planned engines in one background thread (one at a time: two compiling vLLMs on 2 cores only slow
    each other) and stops them at the end of the session."""

    root: Path
    model_paths: dict[str, Callable[[], Path]]  # "tiny" | "smollm2" -> the session's model folder (built once)
    futures: dict[str, Future[SharedEngine]] = field(default_factory=dict)
    started: list[SharedEngine] = field(default_factory=list)
    _thread: threading.Thread | None = None

    def boot(self, fixtures: list[str]) -> None:
        """Start the engines of ``fixtures`` (in that order) in the background; idempotent per fixture."""
        todo = [f for f in fixtures if f in PLAN and f not in self.futures]
        for f in todo:
            self.futures[f] = Future()
        if not todo:
            return

        def run() -> None:
            for f in todo:
                fut = self.futures[f]
                if not fut.set_running_or_notify_cancel():
                    continue
                try:
                    fut.set_result(self._start(PLAN[f]))
                except BaseException as exc:
                    fut.set_exception(exc)

        self._thread = threading.Thread(target=run, name="engine-boot", daemon=True)
        self._thread.start()

    def get(self, fixture: str, timeout: float = 900) -> SharedEngine:
        self.boot([fixture])
        return self.futures[fixture].result(timeout)

    def _start(self, spec: EngineSpec) -> SharedEngine:
        from onlinerl_serving.engine import start_vllm

        model_path = self.model_paths[spec.model]()
        port = free_port()
        child = start_vllm(spec.config(model_path), model_path, self.root / spec.fixture / "vllm.log", port=port)
        engine = SharedEngine(spec, model_path, port, child)
        self.started.append(engine)
        warm_up(engine)
        engine.base_text = engine.greedy()
        engine.publish_kernels()
        return engine

    def stop(self) -> None:
        for fut in self.futures.values():
            fut.cancel()
        if self._thread is not None:
            self._thread.join(timeout=900)
        for engine in self.started:  # all at once: each takes seconds to wind down
            engine.child.signal(signal.SIGTERM)
        for engine in self.started:
            engine.child.stop(timeout=10)


def warm_up(engine: SharedEngine) -> None:
    """One request with what the gateway asks of every request (per-token log-probs and token ids): vLLM-CPU compiles
    its sampler kernel on the first one, so that cost lands in the background boot, not in the first test."""
    body = {
        "model": BASE_NAME,
        "prompt": "def add(a, b):\n    return",
        "max_tokens": 4,
        "temperature": 1.0,
        "logprobs": 0,
        "return_token_ids": True,
    }
    resp = httpx.post(f"{engine.url}/v1/completions", json=body, timeout=300)
    resp.raise_for_status()


@contextlib.contextmanager
def released(engine: SharedEngine, job: str) -> Iterator[SharedEngine]:
    """Lend ``engine`` to one module's job. Afterwards (its reloader stopped) unload the LoRA adapters the job left
    loaded, and check that only the base model remains (full-weight mode: the base's weights answer again, which the
    module restores through the product's own pin/rollback path), so the next module starts where this one did."""
    assert engine.holds_only_the_base(), f"{job}: the shared engine came holding more than the base: {engine.models()}"
    yield engine
    if not engine.child.alive():
        return  # the test failed hard; the next user of this engine fails with the log tail
    engine.publish_kernels()
    for name in sorted(engine.models() - {BASE_NAME}):
        if name.startswith((f"{job}-v", f"{job}@")):  # the shared line's adapters and its projects' (issue 39)
            httpx.post(f"{engine.url}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=30)
    wait_for(engine.holds_only_the_base, 30, interval=0.5, what=f"{job} to leave only the base on the shared engine")


# Engines started by modules of their own (OWN_ENGINES) and restarts of shared ones (RESTARTS), per module: the guard.
own_starts: Counter[str] = Counter()
restarts: Counter[str] = Counter()


def _spend(plan: dict[str, int], spent: Counter[str], test_file: str, what: str) -> None:
    module = Path(test_file).resolve().relative_to(REPO).as_posix()
    allowed = plan.get(module, 0)
    if spent[module] >= allowed:
        raise AssertionError(
            f"{module} {what} (#{spent[module] + 1}), over its plan of {allowed} (tests/engines.py): "
            "use a shared engine fixture, or raise the plan with a reason"
        )
    spent[module] += 1


def start_own_engine(test_file: str, cfg: OnlineRLConfig, model_path: Path, log_path: Path, **kw) -> Child:
    """``start_vllm`` for the modules in :data:`OWN_ENGINES` (``test_file``: the caller's ``__file__``); refuses a
    start past the module's budget."""
    from onlinerl_serving.engine import start_vllm

    _spend(OWN_ENGINES, own_starts, test_file, "starts a vLLM engine of its own")
    return start_vllm(cfg, model_path, log_path, **kw)


def back_to_the_base(r: redis.Redis, job: str, reloader_url: str) -> None:
    """Full-weight mode: give the shared engine back holding the base weights through the product's own path,
    `onlinerl policy pin 0` and the reloader's swap (:func:`released` then checks the base's greedy answer)."""
    from onlinerl.keys import Keys
    from onlinerl.procs import http_ok
    from onlinerl.rollout import manual
    from onlinerl.rollout.store import RolloutStore

    if not http_ok(f"{reloader_url}/healthz"):
        return  # the module failed hard; ``released`` reports what the engine still holds
    manual.pin(RolloutStore(r, Keys(job)), 0, actor="test teardown")
    wait_for(
        lambda: httpx.get(f"{reloader_url}/healthz", timeout=5).json()["holding"] == 0,
        120,
        0.2,
        "the reloader to hold the base again",
    )
