"""The tools behind issue 40's figures: the gateway-alone harness (bench/gateway_cpu.py) and the engine-core isolation
of bench/replicas.py --engine-cores-alone (bench/affinity.py). Behaviour only: no timing is asserted."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.affinity import isolate_engines

ROOT = Path(__file__).resolve().parents[2]
CORES = sorted(os.sched_getaffinity(0))


def test_the_gateway_harness_measures_a_gateway_that_stores_every_record() -> None:
    """A short run exits 0 only when every completion through the gateway had its record stored (the harness reads
    the gateway's /metrics), and prints both modes with the gateway's own CPU and wall time."""
    run = subprocess.run(
        [sys.executable, "bench/gateway_cpu.py", "-n", "40", "--rounds", "2", "--warmup", "3"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {m.group(1): m.groups()[1:] for m in re.finditer(r"^\| (non-stream|stream) \|(.*)\|$", run.stdout, re.M)}
    assert set(rows) == {"non-stream", "stream"}, run.stdout
    for cells in rows.values():
        figures = [float(x) for x in re.findall(r"-?\d+(?:\.\d+)?", cells[0])]
        engine_cpu, gateway_cpu, own = figures[:3]
        assert gateway_cpu > engine_cpu > 0 and own > 0, cells  # the gateway's path costs more than the engine's


def sleeper(*title: str) -> subprocess.Popen:
    """A process whose command line carries ``title`` (vLLM names its engine ``VLLM::EngineCore``), with a thread;
    returned once both threads run (before that, /proc could show the forking pytest's command line, or a thread
    could start after its process was placed and keep the old affinity)."""
    code = (
        "import threading, time; threading.Thread(target=time.sleep, args=(60,)).start(); "
        "print('ready', flush=True); time.sleep(60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, *title], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    return proc


@pytest.mark.skipif(len(CORES) < 2, reason="needs 2 cores")
def test_each_engine_gets_a_core_of_its_own_and_every_other_thread_the_rest() -> None:
    engine, host = sleeper("VLLM::EngineCore"), sleeper()
    try:
        placed = isolate_engines({engine.pid, host.pid})
        assert placed["engine_cores"] == CORES[:1] and placed["host_cores"] == CORES[1:]
        for tid in os.listdir(f"/proc/{engine.pid}/task"):
            assert os.sched_getaffinity(int(tid)) == {CORES[0]}
        for tid in os.listdir(f"/proc/{host.pid}/task"):
            assert os.sched_getaffinity(int(tid)) == set(CORES[1:])
    finally:
        for p in (engine, host):
            p.kill()
            p.wait()


def test_it_refuses_when_no_core_would_be_left_or_no_engine_is_there() -> None:
    engines = [sleeper("VLLM::EngineCore") for _ in CORES]
    host = sleeper()
    try:
        with pytest.raises(RuntimeError, match="no core would be left"):
            isolate_engines({p.pid for p in engines})
        with pytest.raises(RuntimeError, match="no vLLM engine process"):
            isolate_engines({host.pid})
        for tid in os.listdir(f"/proc/{host.pid}/task"):  # a refusal moves nothing
            assert os.sched_getaffinity(int(tid)) == set(CORES)
    finally:
        for p in [*engines, host]:
            p.kill()
            p.wait()
