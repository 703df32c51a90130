"""Fuzz fixtures: one real valkey per module; the serving key ring is reused from tests/serving."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from onlinerl.valkey import EmbeddedValkey
from tests.serving.conftest import keys_file  # noqa: F401  (a fixture, used by test_gateway_fuzz)


@pytest.fixture(scope="module")
def module_valkey(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedValkey]:
    server = EmbeddedValkey(tmp_path_factory.mktemp("valkey")).start()
    try:
        yield server
    finally:
        server.stop()
