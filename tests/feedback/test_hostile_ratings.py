"""Ratings written as attacks (issue 35), through the real feedback service (own process) and a real valkey, with
rollout records stored by the gateway's own record script (``rollouts.record_command``).

- A padded accept: the join accepts whitespace around the served text, so a client may pad an accept of a
  46-character suggestion with 3,000 spaces. The arm's character guardrails must grow by the 46 served characters,
  as the reward pays them, never by the client's 3,046.
- A user key learns nothing about its arm: the reply carries no ``policy_version`` (an eval key still gets it).
- A key that rejects everything is quarantined ("far below" its tenant), as one that accepts everything always was.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import redis

from onlinerl.arms import CANDIDATE, STABLE
from onlinerl.auth import KeyRing
from onlinerl.dataplane.rollouts import record_command
from onlinerl.fim import get_template
from onlinerl.keys import Keys
from onlinerl.rollout.records import ArmStats
from onlinerl_serving.routing import user_hash

from .conftest import FeedbackServer, event, start_feedback, stream_entries
from .rollouts import make_rollout

USER_KEY, EVAL_KEY = "key-acme-1", "key-acme-eval"
TENANTS = {"acme": [USER_KEY, {"key": EVAL_KEY, "role": "eval"}]}
SUGGESTION = "return sorted(items, key=lambda item: item.nm)"  # 46 characters, no whitespace around it
SUBMIT = "/api/training/submit"


@pytest.fixture
def server(module_valkey, tmp_path) -> Iterator[FeedbackServer]:
    srv = start_feedback(tmp_path, module_valkey.url, tenants=TENANTS)
    try:
        yield srv
    finally:
        srv.stop()


def serve(r: redis.Redis, keys: Keys, tokenizer, key: str, i: int, text: str = SUGGESTION, arm: str = CANDIDATE):
    """One completion of v1 served to ``key`` during v1's canary, stored exactly as the gateway stores it."""
    prompt = get_template("qwen").render(f"def by_name_{i}(items):\n    ", "\n")
    rec = make_rollout(tokenizer, tenant="acme", prompt=prompt, completion=text, version=1, arm=arm)
    rec = rec.model_copy(update={"user_hash": user_hash(key), "canary": 1})
    r.execute_command(*record_command(keys, rec, 1800, 1000, False))
    return rec


def rate(http: httpx.Client, srv: FeedbackServer, key: str, body: dict) -> dict:
    resp = http.post(srv.url + SUBMIT, json=body, headers={"Authorization": f"Bearer {key}", "X-Project-ID": "acme"})
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_a_padded_accept_adds_only_the_served_characters(server, r, keys, http, tokenizer) -> None:
    assert len(SUGGESTION) == 46
    rec = serve(r, keys, tokenizer, USER_KEY, 0)
    padded = " " * 1500 + SUGGESTION + " " * 1500  # 3,000 spaces of the client's own
    out = rate(http, server, USER_KEY, event(rec.prompt, padded, accepted=True))
    assert (out["status"], out["match"]) == ("accepted_for_training", "trimmed")

    arm = ArmStats.from_mapping(r.hgetall(keys.stats(1, CANDIDATE)))
    assert (arm.served, arm.shown, arm.accepted) == (1, 1, 1)
    assert (arm.shown_chars, arm.accepted_chars) == (46, 46)  # not 3,046
    ledger = {k.decode(): int(v) for k, v in r.hgetall(keys.arm_users(1, CANDIDATE, 1)).items()}
    mine = user_hash(USER_KEY)
    assert ledger == {
        f"{mine}:served": 1,
        f"{mine}:shown": 1,
        f"{mine}:accepted": 1,
        f"{mine}:shown_chars": 46,
        f"{mine}:accepted_chars": 46,
    }
    (sample,) = stream_entries(r, keys.samples)
    assert sample["reward"] == pytest.approx(0.5 + 0.0125 * 40)  # the reward pays the same 46 (capped at 40)


def test_a_user_key_is_not_told_the_version_an_eval_key_is(server, r, keys, http, tokenizer) -> None:
    user = rate(http, server, USER_KEY, event(serve(r, keys, tokenizer, USER_KEY, 1).prompt, SUGGESTION))
    assert user["status"] == "accepted_for_training" and "rollout_id" in user
    assert "policy_version" not in user
    rec = serve(r, keys, tokenizer, EVAL_KEY, 2, arm=STABLE)
    evaluator = rate(http, server, EVAL_KEY, event(rec.prompt, SUGGESTION))
    assert evaluator["policy_version"] == 1


@pytest.fixture
def watched(module_valkey, tmp_path) -> Iterator[FeedbackServer]:
    keys = [f"key-honest-{i}" for i in range(4)]
    srv = start_feedback(
        tmp_path, module_valkey.url, tenants={"acme": [*keys, "key-nay"]}, limits={"anomalyK": 3, "anomalyMinShown": 10}
    )
    try:
        yield srv
    finally:
        srv.stop()


def test_a_key_rejecting_everything_is_quarantined_far_below_its_tenant(watched, r, keys, http, tokenizer) -> None:
    n = 0
    for i in range(4):  # the rest of the tenant accepts half of its 48 suggestions
        for j in range(12):
            n += 1
            rec = serve(r, keys, tokenizer, f"key-honest-{i}", n)
            assert rate(http, watched, f"key-honest-{i}", event(rec.prompt, SUGGESTION, accepted=j % 2 == 0))[
                "status"
            ] == ("accepted_for_training")
    replies = []
    for _ in range(14):  # one key rejects everything it is shown
        n += 1
        rec = serve(r, keys, tokenizer, "key-nay", n)
        replies.append(rate(http, watched, "key-nay", event(rec.prompt, SUGGESTION, accepted=False)))
    # at its 10th rating 0/10 is more than 3 sigma below 24/48: quarantined; what follows is audited
    assert [x["status"] for x in replies] == ["accepted_for_training"] * 10 + ["rejected"] * 4
    assert {x["reason"] for x in replies[10:]} == {"quarantined"}
    nay = user_id_of(watched, "key-nay")
    assert r.get(keys.quarantine("acme", nay)) == b"accept rate 0/10 far below tenant rest 24/48"
    # its counts left the tenant's totals: the honest users are tested against each other, not against the outlier
    assert {k: int(v) for k, v in r.hgetall(keys.user_stats("acme")).items()} == {b"shown": 48, b"accepted": 24}
    for i in range(4):
        assert not r.exists(keys.quarantine("acme", user_id_of(watched, f"key-honest-{i}")))
    arm = ArmStats.from_mapping(r.hgetall(keys.stats(1, CANDIDATE)))
    assert (arm.shown, arm.accepted) == (58, 24)  # the 4 audited rejects never reached the canary's counters


def user_id_of(srv: FeedbackServer, key: str) -> str:
    """The user the service counts ``key`` under: the key's id (onlinerl.auth), never anything the client sends."""
    identity = KeyRing.from_mapping({"tenants": {"acme": {"keys": [key]}}}).identity_for(key)
    assert identity is not None
    return identity.key_id
