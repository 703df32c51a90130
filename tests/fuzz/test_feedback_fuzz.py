"""Property-based fuzz of the feedback service's public API (``POST /api/training/submit``).

The submit route is raw ASGI in front of FastAPI, so the body's schema is the one pydantic derives from
:class:`onlinerl.schemas.CompletionOutcome` (the model the route validates with). Real processes: the feedback
service (uvicorn) and valkey. Properties: no 5xx; every 4xx is ``{"status": "rejected", "reason", "error": {message,
type, param, code}}`` and names the field or header at fault; a valid upload is acknowledged (200) and its
acknowledgement is in Redis. Hypothesis is derandomized, so CI replays the same cases.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from onlinerl.keys import Keys
from onlinerl.schemas import CompletionOutcome
from onlinerl.valkey import EmbeddedValkey
from tests.feedback.conftest import JOB, KEYS, FeedbackServer, start_feedback
from tests.fuzz.checks import assert_names, assert_not_5xx, error_of
from tests.fuzz.schema_strategies import HEADERS, Mutation, from_schema, mutations

pytestmark = pytest.mark.slow

SUBMIT = "/api/training/submit"
MAX_BODY = 16384  # start_feedback's feedback.maxBodyBytes
FUZZ = settings(derandomize=True, deadline=None, suppress_health_check=list(HealthCheck), database=None)
SCHEMA = CompletionOutcome.model_json_schema(by_alias=True)
KEY = KEYS["acme"][0]
OWN_HEADERS = {b"authorization", b"x-project-id", b"content-type"}
HANDLED = {"accepted_for_training", "unmatched", "duplicate", "rejected", "audited", "quarantined"}


@pytest.fixture(scope="module")
def server(module_valkey: EmbeddedValkey, tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path):
    srv = start_feedback(tmp_path_factory.mktemp("fb-fuzz"), module_valkey.url)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def http(server: FeedbackServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=10) as c:
        yield c


@pytest.fixture(scope="module")
def r(module_valkey: EmbeddedValkey) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(module_valkey.url)
    try:
        yield client
    finally:
        client.close()


def auth(tenant: str = "acme") -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant][0]}", "X-Project-ID": tenant}


def rejection(resp: httpx.Response) -> dict[str, Any]:
    """The service's refusal shape: status, reason, and the OpenAI-style error whose code is the reason."""
    err = error_of(resp)
    body = resp.json()
    assert body["status"] == "rejected" and body["reason"] == err["code"], body
    return err


def kept(r: redis.Redis, acked: dict[str, str]) -> list[str]:
    """The acknowledged entry ids (sample or audit) that are in their stream: what a 200 promised to keep."""
    keys = Keys(JOB)
    streams = {"sample_id": keys.samples, "audit_id": keys.audit}
    return [entry for entry, field in acked.items() if r.xrange(streams[field], entry, entry)]


def test_valid_uploads_are_acknowledged_and_kept(http: httpx.Client, r: redis.Redis) -> None:
    acked: dict[str, str] = {}  # entry id -> sample_id / audit_id

    @settings(FUZZ, max_examples=80)
    @given(from_schema(SCHEMA))
    def check(body: dict[str, Any]) -> None:
        resp = http.post(SUBMIT, content=orjson.dumps(body), headers=auth())
        assert resp.status_code == 200, (resp.status_code, resp.text[:500], body)
        out = resp.json()
        assert out["status"] in HANDLED and out["completion_id"] == body["completionId"], out
        field = "sample_id" if "sample_id" in out else "audit_id"
        acked[out[field]] = field

    check()
    assert len(acked) > 40 and kept(r, acked) == list(acked)


MUST_REFUSE = {"missing_field", "non_json", "not_object", "too_long"}


def test_mutated_uploads_get_4xx_naming_the_field(http: httpx.Client) -> None:
    tally: dict[str, int] = {}

    @settings(FUZZ, max_examples=250)
    @given(mutations(SCHEMA, SCHEMA, huge=MAX_BODY + 1))
    def check(m: Mutation) -> None:
        resp = http.post(SUBMIT, content=m.content, headers={**auth(), "Content-Type": "application/json"})
        assert_not_5xx(resp)
        tally[f"{m.kind}:{resp.status_code}"] = tally.get(f"{m.kind}:{resp.status_code}", 0) + 1
        if resp.status_code == 200:
            assert m.kind not in MUST_REFUSE, (m, resp.text[:300])
            return
        err = rejection(resp)
        if resp.status_code == 413:
            assert_names(err, "maxBodyBytes")
        elif m.kind in ("non_json", "not_object"):
            assert_names(err, "JSON")
        elif m.field is not None:
            assert_names(err, m.field)
        else:
            assert_names(err, *SCHEMA["properties"], "body")

    check()
    print("feedback mutations (kind:status -> count):", dict(sorted(tally.items())))
    assert sum(v for k, v in tally.items() if k.endswith(":422")) > 100  # the fuzz reached the validation


TOKENS = st.sampled_from([None, KEY, KEYS["globex"][0], "wrong", "", KEY[:-1], KEY + " "])
PROJECTS = st.one_of(st.sampled_from([None, "acme", "globex", "", "ACME", " acme"]), st.binary(max_size=8))


def expected(token: str | None, project: str | bytes | None) -> tuple[int, str]:
    tenant = {KEY: "acme", KEYS["globex"][0]: "globex"}.get((token or "").strip())
    if tenant is None:
        return 401, "API key"
    raw = project.encode() if isinstance(project, str) else project
    raw = (raw or b"").strip(b" \t")  # servers strip a header value's surrounding whitespace
    if raw and raw.decode("latin-1") != tenant:  # no (or an empty) X-Project-ID: the key names its project
        return 403, "X-Project-ID"
    return 200, ""


def test_random_headers_get_the_documented_answer(http: httpx.Client) -> None:
    """Keys of both tenants, wrong and missing keys, missing/foreign/odd X-Project-ID, unrelated headers."""

    @settings(FUZZ, max_examples=120)
    @given(token=TOKENS, project=PROJECTS, extra=HEADERS, n=st.integers(0, 10**9))
    def check(token: str | None, project: str | bytes | None, extra: list[tuple[bytes, bytes]], n: int) -> None:
        headers = [(k, v) for k, v in extra if k.lower() not in OWN_HEADERS]
        if token is not None:
            headers.append((b"authorization", f"Bearer {token}".strip().encode()))
        if project is not None:
            value = project.encode() if isinstance(project, str) else project
            headers.append((b"x-project-id", bytes(c for c in value if c >= 0x20 and c != 0x7F).strip()))
        body = {"completionId": f"hdr-{n}", "accepted": False, "prompt": "x", "completion": "y"}
        resp = http.post(SUBMIT, content=orjson.dumps(body), headers=headers)
        assert_not_5xx(resp)
        project_sent = None if project is None else bytes(c for c in headers[-1][1])
        status, needle = expected(token, project_sent)
        assert resp.status_code == status, (token, project, resp.text)
        if status != 200:
            assert_names(rejection(resp), needle)

    check()


def test_declared_oversize_is_413_before_reading(http: httpx.Client) -> None:
    """A Content-Length over the cap is refused from the header alone, naming the cap."""
    resp = http.post(SUBMIT, content=b"{" + b" " * MAX_BODY + b"}", headers=auth())
    assert resp.status_code == 413
    assert_names(rejection(resp), "maxBodyBytes")
