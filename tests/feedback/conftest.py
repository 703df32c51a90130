"""Fixtures for the feedback tests: the real service (uvicorn, own process) against a real valkey."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson
import pytest
import redis
import yaml

from onlinerl.auth import write_keys_file
from onlinerl.keys import Keys
from onlinerl.procs import Child, python_module
from onlinerl.valkey import EmbeddedValkey, free_port

JOB = "fbtest"
KEYS = {"acme": ["key-acme-1"], "globex": ["key-globex-1"]}


def headers(tenant: str = "acme", key: str | None = None, project: str | None = None) -> dict[str, str]:
    out = {"Authorization": f"Bearer {key or KEYS[tenant][0]}"}
    if project != "":
        out["X-Project-ID"] = project or tenant
    return out


def event(prompt: str, completion: str, accepted: bool = True, **extra) -> dict:
    """A body shaped like Continue's AutocompleteOutcome upload."""
    return {
        "completionId": str(uuid.uuid4()),
        "filepath": "file:///w/app.py",
        "prefix": "",
        "suffix": "",
        "prompt": prompt,
        "completion": completion,
        "modelProvider": "openai",
        "modelName": "qwen2.5-coder-1.5b",
        "accepted": accepted,
        "timestamp": "2026-11-21T12:00:00.000Z",
        "time": 1234.0,
        "uniqueId": "inst-1",
        "numLines": completion.count("\n") + 1,
        "cacheHit": False,
        **extra,
    }


@dataclass
class FeedbackServer:
    child: Child
    url: str

    def stop(self) -> None:
        self.child.stop()


def start_feedback(
    tmp: Path,
    redis_url: str,
    env: dict[str, str] | None = None,
    tenants: dict[str, list] | None = None,
    **feedback: object,
) -> FeedbackServer:
    """The real service; ``tenants``: its keys file (default ``KEYS``)."""
    keys_file = write_keys_file(tmp / "keys.yaml", tenants or KEYS)
    cfg = {
        "job": JOB,
        "model": {"fimTemplate": "qwen"},
        "auth": {"apiKeysFile": str(keys_file)},
        "feedback": {"maxBodyBytes": 16384, **feedback},
    }
    (tmp / "config.yaml").write_text(yaml.safe_dump(cfg))
    port = free_port()
    child = Child(
        "feedback",
        python_module("onlinerl_feedback", "--port", str(port), "--host", "127.0.0.1", "--redis-url", redis_url),
        tmp / "feedback.log",
        env={"ONLINERL_CONFIG": str(tmp / "config.yaml"), **(env or {})},
    ).start()
    url = f"http://127.0.0.1:{port}"
    try:
        child.wait_healthy(f"{url}/healthz", timeout=60)
    except Exception:
        child.stop()
        raise
    return FeedbackServer(child, url)


@pytest.fixture(scope="session")
def tokenizer(smollm2_path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_path))


@pytest.fixture(scope="session")
def keys() -> Keys:
    return Keys(JOB)


def stream_entries(client: redis.Redis, stream: str) -> list[dict]:
    return [orjson.loads(fields[b"data"]) for _, fields in client.xrange(stream)]


@pytest.fixture
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=10) as c:
        yield c


@pytest.fixture(scope="module")
def module_valkey(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedValkey]:
    server = EmbeddedValkey(tmp_path_factory.mktemp("valkey")).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def r(module_valkey: EmbeddedValkey) -> Iterator[redis.Redis]:
    """A client of the module's valkey, emptied first: each test starts from no rollouts and no samples."""
    client = redis.Redis.from_url(module_valkey.url)
    client.flushall()
    try:
        yield client
    finally:
        client.close()
