"""One served rollout yields at most one training sample and one count, whatever the completionIds; eval-arm rollouts
are counted under their own arm and never trained. Real service (uvicorn process), real valkey, records as the
gateway writes them (the gateway end of the same rules: test_rollout_rules_through_gateway.py).
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from onlinerl.dataplane.samples import APPEND
from onlinerl.fim import get_template

from .conftest import event, headers, start_feedback, stream_entries
from .rollouts import make_rollout, record_rollout

SUBMIT = "/api/training/submit"
PROMPT = get_template("qwen").render("def mul(a, b):\n", "\n\nprint(mul(2, 3))\n")
TEXT = "    return a * b"


@pytest.fixture(scope="module")
def server(module_valkey, tmp_path_factory):
    srv = start_feedback(tmp_path_factory.mktemp("feedback"), module_valkey.url)
    try:
        yield srv
    finally:
        srv.stop()


def post(http: httpx.Client, server, body: dict, tenant: str = "acme") -> dict:
    resp = http.post(server.url + SUBMIT, json=body, headers=headers(tenant))
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_one_rollout_posted_under_five_completion_ids_trains_once(server, r, keys, http, tokenizer):
    rec = make_rollout(tokenizer, tenant="acme", prompt=PROMPT, completion=TEXT, version=1, arm="candidate")
    record_rollout(r, keys, rec)
    ttl_before = r.ttl(keys.rollouts("acme", PROMPT))
    bodies = [event(PROMPT, TEXT, accepted=i != 2) for i in range(5)]  # a replay may even flip `accepted`
    replies = [post(http, server, b) for b in bodies]
    first, dups = replies[0], replies[1:]
    assert first["status"] == "accepted_for_training" and first["rollout_id"] == rec.rollout_id
    for dup in dups:
        assert (dup["status"], dup["reason"]) == ("duplicate", "rollout_already_rated")
        assert dup["rollout_id"] == rec.rollout_id
        assert (dup["first_outcome"], dup["entry_id"]) == ("accepted_for_training", first["sample_id"])
    (sample,) = stream_entries(r, keys.samples)
    assert sample["event_id"] == bodies[0]["completionId"]
    audit = stream_entries(r, keys.audit)
    assert [a["event_id"] for a in audit] == [b["completionId"] for b in bodies[1:]]
    assert [d["audit_id"] for d in dups] == [i.decode() for i, _ in r.xrange(keys.audit)]
    for entry in audit:
        assert (entry["outcome"], entry["reason"], entry["rollout_id"]) == (
            "duplicate",
            "rollout_already_rated",
            rec.rollout_id,
        )
        assert (entry["first_outcome"], entry["first_entry_id"]) == ("accepted_for_training", first["sample_id"])
    n = str(len(TEXT)).encode()
    assert r.hgetall(keys.stats(1, "candidate")) == {
        b"shown": b"1",
        b"accepted": b"1",
        b"shown_chars": n,
        b"accepted_chars": n,
    }
    # The mark lives in the rollout's own hash, so it expires with the record; it did not touch the hash's TTL.
    assert 0 < r.ttl(keys.rollouts("acme", PROMPT)) <= ttl_before
    # A resend of one of the duplicates is a completionId duplicate of a duplicate: still nothing counted.
    again = post(http, server, bodies[3])
    assert (again["status"], again["reason"]) == ("duplicate", "completion_id_seen")
    assert again["first_outcome"] == "duplicate"
    assert len(stream_entries(r, keys.samples)) == 1 and r.hget(keys.stats(1, "candidate"), "shown") == b"1"
    metrics = http.get(server.url + "/metrics").text
    assert 'onlinerl_feedback_shown_total{arm="candidate",line="shared",version="1"} 1.0' in metrics


def test_concurrent_reposts_of_one_rollout_still_train_once(server, r, keys, tokenizer):
    rec = make_rollout(tokenizer, tenant="acme", prompt=PROMPT, completion=TEXT)
    record_rollout(r, keys, rec)
    bodies = [event(PROMPT, TEXT) for _ in range(5)]

    async def burst() -> list[dict]:
        async with httpx.AsyncClient(timeout=10) as http:
            resps = await asyncio.gather(*(http.post(server.url + SUBMIT, json=b, headers=headers()) for b in bodies))
        assert all(x.status_code == 200 for x in resps), [x.text for x in resps]
        return [x.json() for x in resps]

    replies = asyncio.run(burst())
    statuses = sorted(x["status"] for x in replies)
    assert statuses == ["accepted_for_training"] + ["duplicate"] * 4, replies
    winner = next(x for x in replies if x["status"] == "accepted_for_training")
    assert all(x["reason"] == "rollout_already_rated" for x in replies if x["status"] == "duplicate")
    assert all(x["entry_id"] == winner["sample_id"] for x in replies if x["status"] == "duplicate")
    (sample,) = stream_entries(r, keys.samples)
    assert sample["event_id"] == winner["completion_id"]
    assert len(stream_entries(r, keys.audit)) == 4
    assert r.hget(keys.stats(0, "stable"), "shown") == b"1"
    assert r.hget(keys.stats(0, "stable"), "accepted_chars") == str(len(TEXT)).encode()


def test_two_rollouts_of_the_same_text_are_two_samples_then_duplicates(server, r, keys, http, tokenizer):
    """Two users of one project got the same suggestion: each real rollout counts once, the third event none."""
    a = make_rollout(tokenizer, tenant="acme", prompt=PROMPT, completion=TEXT, created_at=1000.0)
    b = make_rollout(tokenizer, tenant="acme", prompt=PROMPT, completion=TEXT, created_at=2000.0)
    record_rollout(r, keys, a)
    record_rollout(r, keys, b)
    first, second, third = (post(http, server, event(PROMPT, TEXT)) for _ in range(3))
    assert (first["status"], first["rollout_id"]) == ("accepted_for_training", b.rollout_id)  # newest first
    assert (second["status"], second["rollout_id"]) == ("accepted_for_training", a.rollout_id)  # then the unrated
    assert (third["status"], third["reason"]) == ("duplicate", "rollout_already_rated")
    assert len(stream_entries(r, keys.samples)) == 2
    assert r.hget(keys.stats(0, "stable"), "shown") == b"2"


def test_eval_rollout_is_counted_under_eval_only_and_never_trained(server, r, keys, http, tokenizer):
    rec = make_rollout(tokenizer, tenant="acme", prompt=PROMPT, completion=TEXT, version=4, arm="eval")
    record_rollout(r, keys, rec)
    out = post(http, server, event(PROMPT, TEXT, accepted=False))
    assert (out["status"], out["reason"], out["rollout_id"]) == ("rejected", "eval_arm", rec.rollout_id)
    assert stream_entries(r, keys.samples) == []
    (entry,) = stream_entries(r, keys.audit)
    assert (entry["outcome"], entry["reason"], entry["rollout_id"]) == ("rejected", "eval_arm", rec.rollout_id)
    n = str(len(TEXT)).encode()
    assert r.hgetall(keys.stats(4, "eval")) == {b"shown": b"1", b"rejected": b"1", b"shown_chars": n}
    assert sorted(k.decode() for k in r.keys(keys.prefix + "stats:*")) == [keys.stats(4, "eval")]
    replay = post(http, server, event(PROMPT, TEXT, accepted=True))  # replaying it counts nothing more either
    assert (replay["status"], replay["first_outcome"]) == ("duplicate", "rejected")
    assert r.hgetall(keys.stats(4, "eval")) == {b"shown": b"1", b"rejected": b"1", b"shown_chars": n}


def test_user_rollout_wins_over_an_eval_rollout_of_the_same_text(server, r, keys, http, tokenizer):
    user = make_rollout(tokenizer, tenant="acme", prompt=PROMPT, completion=TEXT, created_at=1000.0)
    ev = make_rollout(tokenizer, tenant="acme", prompt=PROMPT, completion=TEXT, arm="eval", created_at=2000.0)
    record_rollout(r, keys, user)
    record_rollout(r, keys, ev)
    out = post(http, server, event(PROMPT, TEXT))
    assert (out["status"], out["rollout_id"]) == ("accepted_for_training", user.rollout_id)
    out = post(http, server, event(PROMPT, TEXT))
    assert (out["status"], out["reason"], out["rollout_id"]) == ("rejected", "eval_arm", ev.rollout_id)
    assert [s["rollout_id"] for s in stream_entries(r, keys.samples)] == [user.rollout_id]


def test_another_tenant_cannot_burn_or_replay_a_rollout(server, r, keys, http, tokenizer):
    rec = make_rollout(tokenizer, tenant="acme", prompt=PROMPT, completion=TEXT)
    record_rollout(r, keys, rec)
    out = post(http, server, event(PROMPT, TEXT), tenant="globex")
    assert (out["status"], out["reason"]) == ("unmatched", "no_rollout")
    assert not r.hexists(keys.rollouts("acme", PROMPT), keys.rated_field(rec.rollout_id))
    assert post(http, server, event(PROMPT, TEXT))["status"] == "accepted_for_training"


def test_append_script_never_leaves_a_rollout_hash_without_ttl(r, keys):
    """The rollout hash expired between our read and the append: the mark recreates it, with the rollout TTL."""
    hash_key = keys.rollouts("acme", "gone")
    no_limit = ["0", "0", "", "", "0", "0", "0", "0", "0", "rejected"]  # not subject to the limit step (limits.py)
    argv = ["3600", b'{"x":1}', "0", "accepted_for_training", keys.rated_field("cmpl-x"), "1800", "100000"]
    argv += [*no_limit, "", "0", "shown", "1"]  # no per-user ledger ('' prefix), then the stats pairs
    per_user = [keys.contrib("acme", "u", 0), keys.quarantine("acme", "u"), keys.user_stats("acme", "u")]
    keys_ = [keys.seen("acme", "c1"), keys.samples, keys.audit, hash_key, keys.stats(0, "stable")]
    keys_ += [*per_user, keys.user_stats("acme"), keys.stats(0, "stable")]  # the last: the unused ledger slot
    created, entry_id, _ = APPEND.run(r, keys_, argv)
    assert created == 1
    assert r.hget(hash_key, keys.rated_field("cmpl-x")) == b"accepted_for_training " + entry_id
    assert 0 < r.ttl(hash_key) <= 1800
    keys_[0] = keys.seen("acme", "c2")
    assert APPEND.run(r, keys_, argv) == [2, b"accepted_for_training " + entry_id]
    assert r.xlen(keys.samples) == 1 and r.hget(keys.stats(0, "stable"), "shown") == b"1"
    assert not r.exists(keys.seen("acme", "c2"))  # the caller audits it as a duplicate (a second write)
