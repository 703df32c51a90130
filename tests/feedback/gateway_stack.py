"""The real gateway (on vLLM with the tiny model) and the real feedback service on one valkey, for feedback tests that
must rate what the gateway actually served."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from onlinerl.auth import write_keys_file
from onlinerl.config import from_mapping
from onlinerl.procs import Child
from onlinerl.valkey import free_port
from onlinerl_serving.engine import start_vllm
from tests.serving.conftest import start_gateway, write_config

from .conftest import JOB, FeedbackServer, start_feedback


@dataclass
class Endpoints:
    api: str  # the gateway's /v1 base
    track: str  # the feedback upload URL
    feedback: FeedbackServer


@contextlib.contextmanager
def gateway_and_feedback(
    tmp: Path,
    redis_url: str,
    model_path: Path,
    tenants: dict[str, list[Any]],
    feedback_redis_url: str | None = None,
    serving: dict[str, Any] | None = None,
    **feedback: Any,
) -> Iterator[Endpoints]:
    """Start vLLM, the gateway (strategy direct) and feedback (``feedback`` settings shared by both); stop them all.
    ``feedback_redis_url``: feedback's own Redis URL (its ACL user) when it differs from the gateway's.
    ``serving``: more settings of the gateway's ``serving`` section."""
    keys_file = write_keys_file(tmp / "keys.yaml", tenants)
    engine_port, gw_port = free_port(), free_port()
    sections = dict(
        job=JOB,
        redis={"url": redis_url},
        auth={"apiKeysFile": str(keys_file)},
        model={"path": str(model_path), "maxModelLen": 2048},
        storage={"checkpointDir": str(tmp / "ckpt")},
        serving={
            "host": "127.0.0.1",
            "port": gw_port,
            "engineUrl": f"http://127.0.0.1:{engine_port}",
            **(serving or {}),
        },
        feedback=feedback,  # the gateway reads it too (which tenants track silence)
        rollout={"strategy": "direct"},
    )
    cfg_path = write_config(tmp / "config.yaml", **sections)
    children: list[Child] = [start_vllm(from_mapping(sections), model_path, tmp / "vllm.log", port=engine_port)]
    fb = None
    try:
        children.append(start_gateway(cfg_path, tmp / "gateway.log", gw_port).child)
        fb = start_feedback(tmp / "feedback", feedback_redis_url or redis_url, tenants=tenants, **feedback)
        yield Endpoints(f"http://127.0.0.1:{gw_port}/v1", f"{fb.url}/api/training/submit", fb)
    finally:
        if fb is not None:
            fb.stop()
        for child in reversed(children):
            child.stop(timeout=5)
