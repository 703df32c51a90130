"""The feedback service publishes its OpenAPI document, and what it says is what the real service answers.

Real processes: the feedback service (uvicorn) and valkey. Every refusal we can provoke from outside (no key, wrong
project, missing project, oversized body, broken JSON, a bad field) is validated against the schema the document
gives for that status code, and its ``reason`` must be one the document lists for it; a valid upload's 200 receipt
is validated against the documented receipt. The body schema is the one the route validates with.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from jsonschema import Draft202012Validator

from onlinerl.schemas import CompletionOutcome
from onlinerl.valkey import EmbeddedValkey
from tests.feedback.conftest import KEYS, FeedbackServer, event, start_feedback

SUBMIT = "/api/training/submit"
MAX_BODY = 16384  # start_feedback's feedback.maxBodyBytes


@pytest.fixture(scope="module")
def server(module_valkey: EmbeddedValkey, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FeedbackServer]:
    srv = start_feedback(tmp_path_factory.mktemp("fb-openapi"), module_valkey.url)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def http(server: FeedbackServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=10) as c:
        yield c


@pytest.fixture(scope="module")
def document(http: httpx.Client) -> dict[str, Any]:
    resp = http.get("/openapi.json")
    assert resp.status_code == 200 and resp.headers["content-type"] == "application/json"
    return resp.json()


def response_validator(document: dict[str, Any], code: int) -> Draft202012Validator:
    """A validator for the JSON body the document promises for ``code`` (its $refs resolved in the document)."""
    schema = document["paths"][SUBMIT]["post"]["responses"][str(code)]["content"]["application/json"]["schema"]
    root = {**schema, "components": document["components"]}
    Draft202012Validator.check_schema(root)
    return Draft202012Validator(root)


def auth(tenant: str = "acme") -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant][0]}", "X-Project-ID": tenant, "Content-Type": "application/json"}


def test_document_describes_the_route_the_service_validates_with(document: dict[str, Any]) -> None:
    assert document["openapi"] == "3.1.0"
    op = document["paths"][SUBMIT]["post"]
    assert op["security"] == [{"bearer": []}]
    assert [p["name"] for p in op["parameters"]] == ["X-Project-ID"]  # optional: the key names its project
    assert not any(p["required"] for p in op["parameters"])
    body = document["components"]["schemas"]["Outcome"]
    expected = CompletionOutcome.model_json_schema(by_alias=True)
    assert body["properties"] == expected["properties"] and body["required"] == ["completionId", "accepted"]
    assert str(MAX_BODY) in op["requestBody"]["description"]
    assert sorted(op["responses"]) == ["200", "400", "401", "403", "413", "422", "429", "503"]
    for code in ("429", "503"):
        assert "Retry-After" in op["responses"][code]["headers"]


REFUSALS = [
    ("no key", {"Content-Type": "application/json"}, None, 401, "unauthorized", None),
    ("unknown key", {**auth(), "Authorization": "Bearer nope"}, None, 401, "unauthorized", None),
    ("another tenant's project", {**auth(), "X-Project-ID": "globex"}, None, 403, "wrong_project", None),
    ("oversized", auth(), b"{" + b" " * (MAX_BODY + 1) + b"}", 413, "body_too_large", None),
    ("broken JSON", auth(), b'{"completionId": ', 422, "invalid_json", None),
    ("not an object", auth(), b"[1, 2]", 422, "invalid_body", None),
    ("bad field", auth(), orjson.dumps(event("p", "c", accepted="maybe")), 422, "invalid_field", "accepted"),
    ("missing field", auth(), orjson.dumps({"accepted": True}), 422, "invalid_field", "completionId"),
    ("long id", auth(), orjson.dumps(event("p", "c", completionId="x" * 257)), 422, "invalid_field", "completionId"),
]


@pytest.mark.parametrize(
    ("headers", "body", "code", "reason", "param"),
    [r[1:] for r in REFUSALS],
    ids=[r[0] for r in REFUSALS],
)
def test_every_refusal_matches_the_document(
    http: httpx.Client,
    document: dict[str, Any],
    headers: dict[str, str],
    body: bytes | None,
    code: int,
    reason: str,
    param: str | None,
) -> None:
    resp = http.post(SUBMIT, content=body if body is not None else orjson.dumps(event("p", "c")), headers=headers)
    assert resp.status_code == code, resp.text
    reply = resp.json()
    errors = sorted(response_validator(document, code).iter_errors(reply), key=str)
    assert not errors, f"{code} body {reply} breaks the document: {errors[0].message}"
    assert reply["reason"] == reason and reply["error"]["code"] == reason
    assert reply["error"]["param"] == param
    if param:
        assert param in reply["error"]["message"]  # the message names the field to fix


def test_a_recorded_upload_matches_the_documented_receipt(http: httpx.Client, document: dict[str, Any]) -> None:
    resp = http.post(SUBMIT, content=orjson.dumps(event("p", "c", completionId="openapi-receipt-1")), headers=auth())
    assert resp.status_code == 200, resp.text
    reply = resp.json()
    assert not list(response_validator(document, 200).iter_errors(reply)), reply
    assert reply["completion_id"] == "openapi-receipt-1" and (reply.get("sample_id") or reply.get("audit_id"))


def test_hostile_paths_do_not_leak_a_framework_schema(http: httpx.Client) -> None:
    """FastAPI's generated docs stay off: the one document is ours (it is the one that describes the raw route)."""
    for path in ("/docs", "/redoc"):
        assert http.get(path).status_code == 404
    assert http.get("/openapi.json").json()["info"]["title"] == "onlinerl feedback"
