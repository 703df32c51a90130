"""``python -m onlinerl_rollout`` as a real process: gates a loaded version, promotes it on live counters, serves
/metrics and /healthz, stops cleanly on SIGTERM; refuses to start without an evaluator when the gate is on."""

from __future__ import annotations

import subprocess
import sys

import httpx
import redis

from onlinerl.keys import Keys
from onlinerl.procs import Child, python_module, wait_for
from onlinerl.schemas import PolicyTable
from onlinerl.valkey import free_port
from tests.rollout.sim import ArmSimulator, Truth, publish_loaded

JOB = "proc"


def env(url: str, **extra: str) -> dict[str, str]:
    return {
        "ONLINERL__REDIS__URL": url,
        "ONLINERL__JOB": JOB,
        "ONLINERL__ROLLOUT__STRATEGY": "canary",
        "ONLINERL__ROLLOUT__CANARY_SHARE": "0.5",
        "ONLINERL__ROLLOUT__MIN_SAMPLES": "100",
        "ONLINERL__ROLLOUT__MIN_DWELL_SECONDS": "0",
        "ONLINERL__ROLLOUT__GATE__EVAL_SAMPLES": "20",
        **extra,
    }


def table(r: redis.Redis) -> PolicyTable:
    return PolicyTable.from_redis(r.hgetall(Keys(JOB).policy))


def test_controller_process_gates_and_promotes(empty_valkey, redis_client, tmp_path) -> None:
    redis_client.hset(Keys(JOB).policy, mapping=PolicyTable(stable=0).to_redis())
    port = free_port()
    child = Child(
        "rollout",
        python_module(
            "onlinerl_rollout",
            "--interval",
            "0.1",
            "--port",
            str(port),
            "--evaluator",
            "tests.rollout.evaluators:plain_code",
        ),
        tmp_path / "rollout.log",
        env=env(empty_valkey.url),
    ).start()
    try:
        child.wait_healthy(f"http://127.0.0.1:{port}/healthz", timeout=30)
        publish_loaded(redis_client, JOB, 1)
        wait_for(lambda: table(redis_client).candidate == 1, timeout=20, what="v1 to pass the gate")
        assert table(redis_client).canary_share == 0.5
        sim = ArmSimulator(redis_client, JOB, {0: Truth(0.2), 1: Truth(0.5)}, seed=1)

        def promoted() -> bool:
            sim.serve(50)
            return table(redis_client).stable == 1

        wait_for(promoted, timeout=30, interval=0.05, what="v1 to be promoted")
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        assert 'onlinerl_rollout_decisions_total{decision="gate_pass"} 1.0' in metrics
        assert 'onlinerl_rollout_decisions_total{decision="promote"} 1.0' in metrics
        assert "onlinerl_rollout_candidate_win_probability" in metrics
        assert httpx.get(f"http://127.0.0.1:{port}/nope").status_code == 404
    finally:
        code = child.stop()
    assert code == 0


def test_refuses_to_start_without_evaluator(empty_valkey) -> None:
    import os

    proc = subprocess.run(
        [sys.executable, "-m", "onlinerl_rollout"],
        env={**os.environ, **env(empty_valkey.url)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "rollout.gate.enabled needs an evaluator" in proc.stderr
