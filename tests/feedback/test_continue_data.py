"""POST /api/training/data, stock Continue's ``data:`` destination, against the real service and a real valkey.

An autocomplete outcome in Continue's dev-data envelope must join and train exactly as the direct upload does (same
reply, same sample); the project comes from the key when no X-Project-ID is sent; what cannot be trained (unknown
schema) is answered 2xx and audited, with one warning per version; what is not an envelope gets a 4xx and writes
nothing. tests/continue/ builds the envelopes with Continue's own published schemas; here they are written by hand,
so the hostile ones can be malformed on purpose.
"""

from __future__ import annotations

import re

import orjson
import pytest

from onlinerl.fim import get_template
from onlinerl.procs import wait_for

from .conftest import event, headers, start_feedback, stream_entries
from .rollouts import make_rollout, record_rollout

SUBMIT = "/api/training/submit"
DATA = "/api/training/data"
QWEN = get_template("qwen")


def prompt(n: int) -> str:
    return QWEN.render(f"def add{n}(a, b):\n", "\n")


@pytest.fixture(scope="module")
def server(module_valkey, tmp_path_factory):
    srv = start_feedback(tmp_path_factory.mktemp("feedback-data"), module_valkey.url)
    try:
        yield srv
    finally:
        srv.stop()


def envelope(data: dict, name: str = "autocomplete", schema: str = "0.2.0", level: str = "all") -> dict:
    """Continue's DataLogger body (core/data/log.ts)."""
    return {"name": name, "data": data, "schema": schema, "level": level, "profileId": "local"}


def continue_data(outcome: dict) -> dict:
    """An AutocompleteOutcome as schema 0.2.0 level all keeps it: no numLines, base values added."""
    kept = {k: v for k, v in outcome.items() if k != "numLines"}
    return {**kept, "eventName": "autocomplete", "schema": "0.2.0", "userId": "u", "userAgent": "vscode"}


def bearer(tenant: str = "acme") -> dict[str, str]:
    return headers(tenant, project="")  # what stock Continue sends: Authorization only


def test_an_outcome_in_the_envelope_trains_exactly_as_the_direct_upload(server, r, keys, http, tokenizer):
    direct, wrapped = event(prompt(1), "    return a + b"), event(prompt(2), "    return a + b")
    replies = []
    for body, path, p in ((direct, SUBMIT, prompt(1)), (envelope(continue_data(wrapped)), DATA, prompt(2))):
        rec = make_rollout(tokenizer, tenant="acme", prompt=p, completion="    return a + b", version=2)
        record_rollout(r, keys, rec)
        resp = http.post(server.url + path, json=body, headers=headers("acme"))
        assert resp.status_code == 200, resp.text
        replies.append(resp.json())
        assert replies[-1]["rollout_id"] == rec.rollout_id
    by_direct, by_envelope = replies
    assert by_envelope["status"] == by_direct["status"] == "accepted_for_training"
    assert sorted(by_envelope) == sorted(by_direct)
    same = ("status", "tenant", "match", "reward", "tokens")
    assert {k: by_envelope[k] for k in same} == {k: by_direct[k] for k in same}
    first, second = stream_entries(r, keys.samples)
    assert second["event_id"] == wrapped["completionId"]
    for field in ("completion_token_ids", "behaviour_logprobs", "reward", "accepted", "shown_text", "match", "arm"):
        assert first[field] == second[field], field
    # repeated: the first delivery's verdict stands, nothing more is trained
    again = http.post(server.url + DATA, json=envelope(continue_data(wrapped)), headers=bearer()).json()
    assert (again["status"], again["reason"]) == ("duplicate", "completion_id_seen")
    assert again["entry_id"] == by_envelope["sample_id"]
    assert len(stream_entries(r, keys.samples)) == 2


def test_without_x_project_id_the_key_names_the_project(server, r, keys, http, tokenizer):
    for tenant, path in (("acme", SUBMIT), ("globex", DATA)):
        rec = make_rollout(tokenizer, tenant=tenant, prompt=prompt(3), completion="    return a * b")
        record_rollout(r, keys, rec)
        body = event(prompt(3), "    return a * b")
        resp = http.post(server.url + path, json=body if path == SUBMIT else envelope(body), headers=bearer(tenant))
        assert resp.status_code == 200, resp.text
        assert (resp.json()["status"], resp.json()["tenant"]) == ("accepted_for_training", tenant)
    assert [s["tenant"] for s in stream_entries(r, keys.samples)] == ["acme", "globex"]


@pytest.mark.parametrize("path", [SUBMIT, DATA])
def test_a_header_naming_another_project_is_still_403(server, r, keys, http, tokenizer, path):
    record_rollout(r, keys, make_rollout(tokenizer, tenant="acme", prompt=prompt(4), completion="    return a"))
    body = event(prompt(4), "    return a")
    resp = http.post(
        server.url + path, json=body if path == SUBMIT else envelope(body), headers=headers("acme", project="globex")
    )
    assert (resp.status_code, resp.json()["reason"]) == (403, "wrong_project")
    assert not stream_entries(r, keys.samples) and not stream_entries(r, keys.audit)


BROKEN = [
    ("not JSON", b'{"name": "autocomplete", ', 422, "invalid_json", None),
    ("not an object", b'["autocomplete"]', 422, "invalid_body", None),
    ("no name", orjson.dumps({"data": {}, "schema": "0.2.0"}), 422, "invalid_field", "name"),
    ("no data", orjson.dumps({"name": "autocomplete", "schema": "0.2.0"}), 422, "invalid_field", "data"),
    ("data not an object", orjson.dumps({"name": "autocomplete", "data": "x"}), 422, "invalid_field", "data"),
    (
        "outcome without accepted",
        orjson.dumps(envelope({"completionId": "c1", "prompt": "p", "completion": "c"})),
        422,
        "invalid_field",
        "data.accepted",
    ),
    ("too large", orjson.dumps(envelope({"prompt": "x" * 17000})), 413, "body_too_large", None),
    ("no key", None, 401, "unauthorized", None),
]


@pytest.mark.parametrize(("body", "code", "reason", "param"), [b[1:] for b in BROKEN], ids=[b[0] for b in BROKEN])
def test_what_is_not_continues_envelope_gets_a_clear_4xx_and_writes_nothing(
    server, r, keys, http, body, code, reason, param
):
    hdrs = {"Content-Type": "application/json", **(bearer() if body is not None else {})}
    resp = http.post(server.url + DATA, content=body if body is not None else b"{}", headers=hdrs)
    assert resp.status_code == code, resp.text
    out = resp.json()
    assert (out["status"], out["reason"], out["error"]["param"]) == ("rejected", reason, param)
    if param:
        assert param in out["error"]["message"]
    assert not stream_entries(r, keys.samples) and not stream_entries(r, keys.audit)


def test_an_unknown_schema_is_answered_audited_counted_and_warned_about_once(server, r, keys, http, tokenizer):
    record_rollout(r, keys, make_rollout(tokenizer, tenant="acme", prompt=prompt(5), completion="    return b"))
    bodies = [envelope(event(prompt(5), "    return b"), schema="0.9.0") for _ in range(3)]
    bodies.append(envelope({"tokens": 3}, name="tokensGenerated", schema="0.9.0"))
    for body in bodies:
        resp = http.post(server.url + DATA, json=body, headers=bearer())
        assert resp.status_code == 200, resp.text
        assert (resp.json()["status"], resp.json()["reason"]) == ("rejected", "unknown_schema")
        assert resp.json()["audit_id"]
    assert not stream_entries(r, keys.samples)
    audited = stream_entries(r, keys.audit)
    assert [a["reason"] for a in audited] == ["unknown_schema"] * 4
    assert audited[0]["event_id"] == bodies[0]["data"]["completionId"] and audited[0]["completion"] == "    return b"
    metrics = http.get(server.url + "/metrics").text
    assert 'onlinerl_feedback_continue_events_total{name="autocomplete",schema="unknown"} 3.0' in metrics
    assert 'onlinerl_feedback_continue_events_total{name="tokensGenerated",schema="unknown"} 1.0' in metrics
    log = server.child.log_path.read_text()
    assert len(re.findall(r"dev-data schema '0\.9\.0'", log)) == 1, log[-2000:]


def test_other_events_are_answered_counted_and_ignored(server, r, keys, http):
    for name in ("tokensGenerated", "chatFeedback", "nextEditOutcome", "somethingNew"):
        resp = http.post(server.url + DATA, json=envelope({"x": 1}, name=name), headers=bearer())
        assert resp.status_code == 200, resp.text
        assert resp.json() == {
            "status": "ignored",
            "name": name if name != "somethingNew" else "other",
            "tenant": "acme",
        }
    assert not stream_entries(r, keys.samples) and not stream_entries(r, keys.audit)
    wait_for(
        lambda: (
            'onlinerl_feedback_continue_events_total{name="other",schema="0.2.0"}'
            in http.get(server.url + "/metrics").text
        ),
        timeout=5,
        what="the count of an unknown event name",
    )


def test_an_outcome_without_its_code_is_audited_never_trained(server, r, keys, http, tokenizer):
    record_rollout(r, keys, make_rollout(tokenizer, tenant="acme", prompt=prompt(6), completion="    return 6"))
    full = continue_data(event(prompt(6), "    return 6"))
    no_code = {k: v for k, v in full.items() if k not in ("prefix", "suffix", "prompt", "completion")}
    resp = http.post(server.url + DATA, json=envelope(no_code, level="noCode"), headers=bearer())
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert (out["status"], out["reason"], out["completion_id"]) == ("rejected", "no_code", full["completionId"])
    assert not stream_entries(r, keys.samples)
    (entry,) = stream_entries(r, keys.audit)
    assert (entry["reason"], entry["event_id"], entry["accepted"]) == ("no_code", full["completionId"], True)
    # the rollout stays unrated: the same outcome with its code still trains
    resp = http.post(server.url + DATA, json=envelope({**full, "completionId": "with-code"}), headers=bearer())
    assert resp.json()["status"] == "accepted_for_training"
