"""A local stack of the real serving and feedback processes (embedded valkey, vLLM on CPU, gateway, feedback), for
loop tests that drive the trainer's own code in-process. Stopped with ``stack.stop()``."""

from __future__ import annotations

from pathlib import Path

import yaml

from onlinerl.config import OnlineRLConfig
from onlinerl.loop.stack import Stack, StackPaths, effective_config, ensure_demo_key, start_valkey
from onlinerl.valkey import free_port
from onlinerl_serving.engine import start_vllm


def start_serving_and_feedback(cfg: OnlineRLConfig, paths: StackPaths, model_path: Path) -> Stack:
    """Valkey, vLLM, the gateway and the feedback service for ``cfg``, healthy; the caller stops the stack."""
    running = Stack(cfg, paths)
    try:
        running.valkey = start_valkey(paths, cfg.job, free_port())  # one ACL user per component, as `onlinerl up`
        running.api_key = ensure_demo_key(paths)
        running.cfg = effective_config(cfg, paths, running.valkey.url, model_path)
        paths.config.write_text(yaml.safe_dump(running.cfg.dump(), sort_keys=False))
        engine_port = int(running.cfg.serving.engine_url.rsplit(":", 1)[1])
        running.children.append(
            start_vllm(running.cfg, model_path, paths.logs / "vllm.log", port=engine_port, wait_timeout=600)
        )
        c = running.cfg
        running.start_child("gateway", "onlinerl_serving.gateway", f"http://127.0.0.1:{c.serving.port}/healthz", 60)
        running.start_child("feedback", "onlinerl_feedback", f"http://127.0.0.1:{c.feedback.port}/healthz", 60)
    except BaseException:
        running.stop()
        raise
    return running
