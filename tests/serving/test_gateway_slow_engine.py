"""A slow engine is a 504 with a message, not a 503; a body without ``max_tokens`` gets OpenAI's default (16).

The attack (or the careless client): a completion body without ``max_tokens`` used to get ``serving.maxTokensCap``
(4,096 tokens): minutes of CPU generation, answered 503 "engine unavailable" once the upstream timeout passed, while
the engine was healthy, and 503 tells the client to back off and send the same request again. Here a real gateway
sits in front of an engine that accepts each request and never answers (the slow engine, on demand): the client
gets 504 naming the timeout and what to change, without a Retry-After, within the timeout (no silent retry doubling
it). 503 with Retry-After stays for an engine that is down (tests/serving/test_gateway_errors.py). The 200 within
seconds for a body without ``max_tokens`` on a real vLLM is tests/loop/test_up_safe_defaults.py.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from onlinerl.config import ServingConfig, from_mapping
from onlinerl.valkey import EmbeddedValkey, free_port
from onlinerl_serving.openapi import openapi_document
from onlinerl_serving.requests import Limits, parse_completion_request
from tests.serving.conftest import KEY_ACME, Gateway, gateway_in_front_of

TIMEOUT_S = 1.5


class SilentEngine:
    """Accepts a connection, reads the request, never answers (vLLM generating 4,096 tokens on a slow CPU)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.requests = 0
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        threading.Thread(target=self._run, args=(ready,), daemon=True).start()
        assert ready.wait(10)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", self.port))
        ready.set()
        self.loop.run_forever()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            self.requests += 1  # headers of one request (GET /v1/models from the gateway's refresh too)
            await asyncio.sleep(3600)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture(scope="module")
def slow(tmp_path_factory: pytest.TempPathFactory, module_valkey: EmbeddedValkey, keys_file: Path) -> Iterator[Gateway]:
    engine = SilentEngine()
    gw = gateway_in_front_of(
        tmp_path_factory.mktemp("gw-slow"),
        module_valkey.url,
        keys_file,
        f"http://127.0.0.1:{engine.port}",
        requestTimeoutSeconds=TIMEOUT_S,
        retryAfterSeconds=3,
    )
    try:
        yield gw
    finally:
        gw.child.stop()
        engine.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_that_outlives_the_timeout_is_504_with_a_message(slow: Gateway, stream: bool) -> None:
    body = {"prompt": "def add(a, b):\n    return ", "stream": stream}
    with slow.client(timeout=30) as c:
        t0 = time.monotonic()
        resp = c.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY_ACME}"})
        took = time.monotonic() - t0
    assert resp.status_code == 504, resp.text
    err = resp.json()["error"]
    assert err["code"] == "engine_timeout" and err["type"] == "server_error"
    assert "requestTimeoutSeconds" in err["message"] and "max_tokens" in err["message"]
    assert "retry-after" not in resp.headers  # the same request would time out again
    assert TIMEOUT_S <= took < 2 * TIMEOUT_S + 1.0, took  # once, not retried on another connection
    with slow.client() as c:
        metrics = c.get("/metrics").text
    assert 'code="504"' in metrics


def test_no_max_tokens_is_openais_default_and_the_cap_still_bounds() -> None:
    limits = Limits(max_prompt_chars=100, max_tokens_cap=4096, max_model_len=2048)
    assert parse_completion_request(orjson.dumps({"prompt": "x"}), limits).max_tokens == 16
    assert parse_completion_request(orjson.dumps({"prompt": "x", "max_tokens": None}), limits).max_tokens == 16
    assert parse_completion_request(orjson.dumps({"prompt": "x", "max_tokens": 64}), limits).max_tokens == 64
    cfg = from_mapping({"serving": {"defaultMaxTokens": 48}}).serving
    own = Limits(100, cfg.max_tokens_cap, 2048, cfg.default_max_tokens)
    assert parse_completion_request(orjson.dumps({"prompt": "x"}), own).max_tokens == 48
    assert ServingConfig().default_max_tokens == 16
    assert from_mapping({"serving": {"maxTokensCap": 8}}).serving.default_max_tokens == 8  # yields to a small cap
    props = openapi_document(limits, "m")["components"]["schemas"]["CompletionRequest"]["properties"]
    assert props["max_tokens"]["anyOf"][0]["default"] == 16  # the published API says so


def test_a_default_above_the_cap_is_refused_naming_both() -> None:
    with pytest.raises(ValueError, match=r"defaultMaxTokens .*maxTokensCap"):
        from_mapping({"serving": {"defaultMaxTokens": 100, "maxTokensCap": 50}})
