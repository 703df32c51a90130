"""Gateway error contract without an engine: auth, limits, malformed bodies, engine down, Redis down.

A real gateway process and a real valkey; the engine URL points at a port nobody listens on, so every request that
passes validation meets a dead engine. Each error must carry the documented status and an OpenAI error body.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from onlinerl.fim import get_template
from onlinerl.procs import wait_for
from onlinerl.valkey import EmbeddedValkey, free_port
from tests.serving.conftest import KEY_ACME, Gateway, gateway_in_front_of

MAX_PROMPT_CHARS = 2000
MAX_TOKENS_CAP = 4096
REQUEST_TIMEOUT_S = 30.0  # the longest the gateway would wait for an engine that accepted the connection


@pytest.fixture(scope="module")
def gateway(
    tmp_path_factory: pytest.TempPathFactory, module_valkey: EmbeddedValkey, keys_file: Path
) -> Iterator[Gateway]:
    gw = gateway_in_front_of(
        tmp_path_factory.mktemp("gw-errors"),
        module_valkey.url,
        keys_file,
        f"http://127.0.0.1:{free_port()}",  # nobody listens: every valid request meets a dead engine
        maxPromptChars=MAX_PROMPT_CHARS,
        maxTokensCap=MAX_TOKENS_CAP,
        engineConnectTimeoutSeconds=1.0,
        requestTimeoutSeconds=REQUEST_TIMEOUT_S,
        retryAfterSeconds=3,
    )
    try:
        yield gw
    finally:
        gw.child.stop()


def continue_body(**over: object) -> dict:
    """Continue's autocomplete request for a Qwen-coder model (see shared/reference/continue-client.md)."""
    qwen = get_template("qwen")
    body = {
        "model": "qwen2.5-coder-1.5b",
        "prompt": qwen.render("def add(a, b):\n    return ", "\n"),
        "max_tokens": MAX_TOKENS_CAP,
        "temperature": 0.01,
        "stop": list(qwen.stop),
        "stream": True,
    }
    body.update(over)
    return body


def auth(key: str = KEY_ACME) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", "api-key": key}


def assert_openai_error(resp: httpx.Response, status: int, *needles: str) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    for n in needles:
        assert n in err["message"], err["message"]
    return err


def test_missing_or_unknown_key_is_401(gateway: Gateway) -> None:
    with gateway.client() as c:
        assert_openai_error(c.post("/v1/completions", json=continue_body()), 401, "API key")
        assert_openai_error(c.post("/v1/completions", json=continue_body(), headers=auth("sk-wrong")), 401)
        assert_openai_error(
            c.post("/v1/completions", json=continue_body(), headers={"Authorization": "Basic " + KEY_ACME}), 401
        )
        assert_openai_error(c.get("/v1/models"), 401)
        assert c.get("/v1/models", headers=auth()).json()["data"][0]["id"] == "onlinerl-base"


def test_either_auth_header_is_enough(gateway: Gateway) -> None:
    """Past auth, the dead engine answers: 503 proves the key was accepted."""
    with gateway.client() as c:
        for headers in ({"Authorization": f"Bearer {KEY_ACME}"}, {"api-key": KEY_ACME}, auth()):
            assert c.post("/v1/completions", json=continue_body(stream=False), headers=headers).status_code == 503


@pytest.mark.parametrize(
    ("override", "param", "needle"),
    [
        ({"max_tokens": MAX_TOKENS_CAP + 1}, "max_tokens", f"serving.maxTokensCap={MAX_TOKENS_CAP}"),
        ({"prompt": "x" * (MAX_PROMPT_CHARS + 1)}, "prompt", f"serving.maxPromptChars={MAX_PROMPT_CHARS}"),
    ],
)
def test_over_a_cap_is_400_naming_the_cap(gateway: Gateway, override: dict, param: str, needle: str) -> None:
    with gateway.client() as c:
        err = assert_openai_error(
            c.post("/v1/completions", json=continue_body(**override), headers=auth()), 400, needle
        )
    assert err["param"] == param


@pytest.mark.parametrize(
    ("content", "param", "needle"),
    [
        (b"{not json", None, "not valid JSON"),
        (b"[1, 2]", None, "JSON object"),
        (b'{"max_tokens": 5}', "prompt", "`prompt` is required"),
        (b'{"prompt": "x", "stream": "yes"}', "stream", "`stream`"),
        (b'{"prompt": "x", "max_tokens": -1}', "max_tokens", "positive integer"),
        (b'{"prompt": "x", "stop": [1]}', "stop", "`stop`"),
        (b'{"prompt": "x", "temperature": "hot"}', "temperature", "number"),
        (b'{"prompt": "x", "n": 2}', "n", "n: 1"),
        (b'{"prompt": "x", "suffix": "y"}', "suffix", "FIM"),
        (b'{"prompt": "x", "logprobs": 9}', "logprobs", "0 to 5"),
    ],
)
def test_malformed_body_is_400_naming_the_field(
    gateway: Gateway, content: bytes, param: str | None, needle: str
) -> None:
    with gateway.client() as c:
        err = assert_openai_error(c.post("/v1/completions", content=content, headers=auth()), 400, needle)
    assert err["param"] == param


def test_huge_body_is_413(gateway: Gateway) -> None:
    with gateway.client() as c:
        resp = c.post(
            "/v1/completions", content=b'{"prompt": "' + b"x" * (MAX_PROMPT_CHARS * 4 + 70_000) + b'"}', headers=auth()
        )
    assert_openai_error(resp, 413, "maxPromptChars")


def test_chunked_body_over_the_cap_is_413(gateway: Gateway) -> None:
    """Hostile: no Content-Length (chunked upload); the shared read_capped stops it at the cap, same error body."""
    cap = MAX_PROMPT_CHARS * 4 + 64 * 1024  # the gateway's body cap for this maxPromptChars

    def chunks() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(cap // 8192 + 2):
            yield b"x" * 8192

    with gateway.client() as c:
        resp = c.post("/v1/completions", content=chunks(), headers=auth())
    err = assert_openai_error(resp, 413, f"over {cap} bytes", "serving.maxPromptChars=2000")
    assert err["code"] == "body_too_large" and err["type"] == "invalid_request_error"


@pytest.mark.parametrize("stream", [True, False])
def test_engine_down_is_fast_503_with_retry_after(gateway: Gateway, stream: bool) -> None:
    with gateway.client() as c:
        t0 = time.monotonic()
        resp = c.post("/v1/completions", json=continue_body(stream=stream), headers=auth())
        elapsed = time.monotonic() - t0
        assert_openai_error(resp, 503, "engine")
        assert resp.headers["retry-after"] == "3"
        # from the refused connection, not after waiting out the request timeout (or a 504 from it)
        assert elapsed < REQUEST_TIMEOUT_S, f"engine-down answer took {elapsed:.2f}s"
        ready = c.get("/readyz")
        assert ready.status_code == 503 and ready.json()["engine"] is False and ready.json()["redis"] is True
        metrics = c.get("/metrics").text
    assert 'onlinerl_serving_requests_total{arm="-",code="503",tenant="acme",version="-"}' in metrics
    assert "onlinerl_serving_engine_up 0.0" in metrics


def test_redis_down_is_503(gateway: Gateway, module_valkey: EmbeddedValkey) -> None:
    """Last in the module: stops the module's valkey. Without the rollout store nothing may be served."""
    module_valkey.stop()
    with gateway.client() as c:
        wait_for(lambda: c.get("/readyz").json()["redis"] is False, 10, what="gateway to notice Redis is down")
        resp = c.post("/v1/completions", json=continue_body(), headers=auth())
    assert_openai_error(resp, 503, "Redis")
    assert resp.headers["retry-after"] == "3"
