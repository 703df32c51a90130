"""The real gateway (on the session's shared vLLM engine) and the real feedback service on one valkey, for feedback
tests that must rate what the gateway actually served. On the full-weights engine the serving pod's reloader runs too
(it is what swaps published weights into vLLM), and the engine is given back holding the base."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from onlinerl.auth import write_keys_file
from onlinerl.procs import Child
from onlinerl.valkey import EmbeddedValkey, free_port
from tests.engines import SharedEngine, back_to_the_base, released
from tests.serving.conftest import start_gateway, start_reloader, write_config

from .conftest import JOB, FeedbackServer, start_feedback


@dataclass
class Endpoints:
    api: str  # the gateway's /v1 base
    track: str  # the feedback upload URL
    feedback: FeedbackServer
    config: Path  # the config file both services read
    reloader: str = ""  # the reloader's base URL (full-weights engine only)


@contextlib.contextmanager
def gateway_and_feedback(
    tmp: Path,
    redis_url: str,
    engine: SharedEngine,
    tenants: dict[str, list[Any]],
    feedback_redis_url: str | None = None,
    serving: dict[str, Any] | None = None,
    reloader_redis_url: str | None = None,
    admin_redis_url: str | None = None,
    **feedback: Any,
) -> Iterator[Endpoints]:
    """Start the gateway (strategy direct) on ``engine`` and feedback (``feedback`` settings shared by both); stop them.
    ``feedback_redis_url``: feedback's own Redis URL (its ACL user) when it differs from the gateway's.
    ``serving``: more settings of the gateway's ``serving`` section.
    On the full-weights engine the reloader runs too (``reloader_redis_url``: its own user), and afterwards
    `onlinerl policy pin 0` (as ``admin_redis_url``) swaps the base back in before the engine is given back."""
    full = engine.spec.weights_mode == "full"
    keys_file = write_keys_file(tmp / "keys.yaml", tenants)
    gw_port = free_port()
    sections = dict(
        job=JOB,
        redis={"url": redis_url},
        auth={"apiKeysFile": str(keys_file)},
        model={"path": str(engine.model_path), "maxModelLen": engine.spec.max_model_len},
        storage={"checkpointDir": str(tmp / "ckpt")},
        serving={
            "host": "127.0.0.1",
            "port": gw_port,
            "engineUrl": engine.url,
            "weightsMode": engine.spec.weights_mode,
            **(serving or {}),
        },
        trainer={"weights": engine.spec.weights_mode},  # what a published version is: the reloader checks it
        feedback=feedback,  # the gateway reads it too (which tenants track silence)
        rollout={"strategy": "direct"},
    )
    cfg_path = write_config(tmp / "config.yaml", **sections)
    children: list[Child] = []
    fb = None
    rl_port = free_port()
    reloader = f"http://127.0.0.1:{rl_port}" if full else ""
    with released(engine, JOB):
        try:
            children.append(start_gateway(cfg_path, tmp / "gateway.log", gw_port).child)
            if full:
                env = {"ONLINERL__REDIS__URL": reloader_redis_url or redis_url}
                children.append(start_reloader(cfg_path, tmp / "reloader.log", rl_port, env))
            fb = start_feedback(tmp / "feedback", feedback_redis_url or redis_url, tenants=tenants, **feedback)
            yield Endpoints(f"http://127.0.0.1:{gw_port}/v1", f"{fb.url}/api/training/submit", fb, cfg_path, reloader)
        finally:
            try:
                if fb is not None:
                    fb.stop()
                if full:
                    with redis.Redis.from_url(admin_redis_url or redis_url) as admin:
                        back_to_the_base(admin, JOB, reloader)
            finally:
                for child in reversed(children):
                    child.stop(timeout=5)


@contextlib.contextmanager
def as_own_users(
    vk: EmbeddedValkey, tmp: Path, engine: SharedEngine, tenants: dict[str, list[Any]]
) -> Iterator[tuple[redis.Redis, Endpoints]]:
    """``gateway_and_feedback`` on a locked-down valkey, each service as its own ACL user (as `onlinerl up` runs
    them), with an admin client for the test; afterwards (services stopped) none was refused anything."""
    admin = redis.Redis.from_url(vk.url)
    admin.acl_log_reset()
    try:
        with gateway_and_feedback(
            tmp,
            vk.url_for("gateway"),
            engine,
            tenants,
            feedback_redis_url=vk.url_for("feedback"),
            reloader_redis_url=vk.url_for("reloader"),
            admin_redis_url=vk.url,
        ) as ep:
            yield admin, ep
        assert admin.acl_log() == []  # both services did all of it as their own users
    finally:
        admin.close()
