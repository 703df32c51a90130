"""A local stack of the real serving and feedback processes (embedded valkey, the gateway and feedback in front of a
shared vLLM engine), for loop tests that drive the trainer's own code in-process. Stopped with ``stack.stop()``."""

from __future__ import annotations

import yaml

from onlinerl.config import OnlineRLConfig
from onlinerl.loop.stack import Stack, StackPaths, effective_config, ensure_demo_key, start_valkey
from onlinerl.valkey import free_port
from tests.engines import SharedEngine


def on_engine(cfg: OnlineRLConfig, engine: SharedEngine) -> OnlineRLConfig:
    """``cfg`` served by ``engine``: its URL and its model folder."""
    data = cfg.dump()
    data["serving"]["engineUrl"] = engine.url
    data["model"]["path"] = str(engine.model_path)
    return OnlineRLConfig.model_validate(data)


def start_serving_and_feedback(cfg: OnlineRLConfig, paths: StackPaths, engine: SharedEngine) -> Stack:
    """Valkey, the gateway and the feedback service for ``cfg`` on ``engine``, healthy; the caller stops the stack
    (the engine stays: it is the session's)."""
    cfg = on_engine(cfg, engine)
    running = Stack(cfg, paths)
    try:
        running.valkey = start_valkey(paths, cfg.job, free_port())  # one ACL user per component, as `onlinerl up`
        running.api_key = ensure_demo_key(paths)
        running.cfg = effective_config(cfg, paths, running.valkey.url, engine.model_path)
        paths.config.write_text(yaml.safe_dump(running.cfg.dump(), sort_keys=False))
        c = running.cfg
        running.start_child("gateway", "onlinerl_serving.gateway", f"http://127.0.0.1:{c.serving.port}/healthz", 60)
        running.start_child("feedback", "onlinerl_feedback", f"http://127.0.0.1:{c.feedback.port}/healthz", 60)
    except BaseException:
        running.stop()
        raise
    return running
