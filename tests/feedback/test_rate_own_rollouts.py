"""Rate only your own rollouts (issue 35), through the real feedback service (own process) on a real valkey with the
rollout records the gateway writes (``user_hash`` = the gateway's hash of the key it served).

The attack: Mallory holds a key of the same tenant as Alice and knows (or guesses) a prompt Alice was served. Under
the default ``feedback.rateScope: user`` her rating of Alice's completion is audited with reason ``not_own_rollout``:
nothing trained, no arm counter moved, nothing counted against either user, and Alice's rollout stays unrated so
Alice's own rating still trains. ``rateScope: tenant`` is the documented opt-out: any key of the tenant rates, and the
contribution counts against the key that rated.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from onlinerl.auth import KeyRing
from onlinerl.fim import get_template
from onlinerl.keys import Keys
from onlinerl_feedback.limits import user_of

from .conftest import FeedbackServer, event, start_feedback, stream_entries
from .rollouts import make_rollout, record_rollout

SUBMIT = "/api/training/submit"
TEXT = "    return a - b"
ALICE, MALLORY = "key-acme-1", "key-acme-mallory"
TENANTS = {"acme": [ALICE, MALLORY], "globex": ["key-globex-1"]}
LIMITS = {"maxSamplesPerUserPerHour": 100, "anomalyK": 0}


def prompt(i: int) -> str:
    return get_template("qwen").render(f"def sub_{i}(a, b):\n", "\n")


def user_id(key: str) -> str:
    identity = KeyRing.from_mapping({"tenants": {t: {"keys": ks} for t, ks in TENANTS.items()}}).identity_for(key)
    assert identity is not None
    return user_of(identity.key_id)


def start(tmp: Path, url: str, **feedback: object) -> FeedbackServer:
    """The real service with both acme keys, each contribution counted (limits on, anomaly test off)."""
    return start_feedback(tmp, url, tenants=TENANTS, limits=LIMITS, **feedback)


@pytest.fixture(scope="module")
def per_user(module_valkey, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FeedbackServer]:
    srv = start(tmp_path_factory.mktemp("fb-user"), module_valkey.url)
    try:
        yield srv
    finally:
        srv.stop()


def rate(http: httpx.Client, srv: FeedbackServer, key: str, p: str, text: str = TEXT, accepted: bool = True) -> dict:
    resp = http.post(
        srv.url + SUBMIT,
        json=event(p, text, accepted=accepted),
        headers={"Authorization": f"Bearer {key}", "X-Project-ID": "acme"},
    )
    assert resp.status_code == 200, resp.text
    return resp.json()


def served_to_alice(r: redis.Redis, keys: Keys, tokenizer, i: int):
    record = make_rollout(
        tokenizer, tenant="acme", prompt=prompt(i), completion=TEXT, version=1, arm="candidate", user_key=ALICE
    )
    record_rollout(r, keys, record)
    return record


def contributions(r: redis.Redis, keys: Keys, key: str) -> int:
    pattern = keys.contrib("acme", user_id(key), 0).rsplit(":", 1)[0] + ":*"
    return sum(int(r.get(k) or 0) for k in r.scan_iter(match=pattern))


def arm_counters(r: redis.Redis, keys: Keys) -> dict[bytes, bytes]:
    return r.hgetall(keys.stats(1, "candidate"))


@pytest.mark.parametrize(
    "text",
    [TEXT, TEXT + "\n", "  " + TEXT.strip() + "   ", TEXT[:8]],
    ids=["exact", "trailing-newline", "padded", "prefix"],
)
def test_another_key_of_the_tenant_cannot_rate_alices_rollout(r, keys, http, tokenizer, per_user, text) -> None:
    record = served_to_alice(r, keys, tokenizer, 1)
    reply = rate(http, per_user, MALLORY, record.prompt, text)
    assert reply["status"] == "rejected" and reply["reason"] == "not_own_rollout", reply
    assert "rollout_id" not in reply and "sample_id" not in reply  # nothing of Alice's rollout is told to Mallory
    assert r.xlen(keys.samples) == 0  # nothing trained
    assert arm_counters(r, keys) == {}  # no arm counter moved
    assert contributions(r, keys, MALLORY) == 0 and contributions(r, keys, ALICE) == 0
    [audited] = stream_entries(r, keys.audit)
    assert (audited["outcome"], audited["reason"], audited["rollout_id"]) == (
        "rejected",
        "not_own_rollout",
        record.rollout_id,
    )
    assert r.hget(keys.rollouts("acme", record.prompt), keys.rated_field(record.rollout_id)) is None
    # Alice's own rating is not pre-empted: it trains, counts once, against Alice
    mine = rate(http, per_user, ALICE, record.prompt)
    assert mine["status"] == "accepted_for_training" and mine["rollout_id"] == record.rollout_id, mine
    [sample] = stream_entries(r, keys.samples)
    assert sample["rollout_id"] == record.rollout_id
    assert contributions(r, keys, ALICE) == 1 and contributions(r, keys, MALLORY) == 0
    assert int(arm_counters(r, keys)[b"accepted"]) == 1


def test_a_rating_of_a_foreign_rollout_never_falls_back_to_an_unverified_sample(
    r, keys, http, tokenizer, module_valkey, tmp_path
) -> None:
    """``trainUnmatched`` trains the newest unrated rollout of a prompt on a text mismatch: never another key's."""
    srv = start(tmp_path, module_valkey.url, trainUnmatched=True)
    try:
        record = served_to_alice(r, keys, tokenizer, 2)
        assert rate(http, srv, MALLORY, record.prompt, "something else entirely")["reason"] == "no_rollout"
        assert rate(http, srv, MALLORY, record.prompt)["reason"] == "not_own_rollout"
        assert r.xlen(keys.samples) == 0
        reply = rate(http, srv, ALICE, record.prompt, "    return a - b - 1")  # her own: the unverified fallback
        assert reply["status"] == "accepted_for_training" and reply["match"] == "unverified", reply
    finally:
        srv.stop()


def test_alices_own_duplicates_and_other_tenants_are_unchanged(r, keys, http, tokenizer, per_user) -> None:
    record = served_to_alice(r, keys, tokenizer, 3)
    assert rate(http, per_user, ALICE, record.prompt)["status"] == "accepted_for_training"
    again = rate(http, per_user, ALICE, record.prompt)
    assert again["status"] == "duplicate" and again["reason"] == "rollout_already_rated"
    assert rate(http, per_user, MALLORY, record.prompt)["reason"] == "not_own_rollout"  # rated or not: not hers
    foreign = http.post(
        per_user.url + SUBMIT,
        json=event(record.prompt, TEXT),
        headers={"Authorization": "Bearer key-globex-1", "X-Project-ID": "globex"},
    ).json()
    assert foreign["status"] == "unmatched" and foreign["reason"] == "no_rollout"  # tenants stay apart
    assert r.xlen(keys.samples) == 1


def test_tenant_scope_lets_any_key_rate_and_counts_the_rater(r, keys, http, tokenizer, module_valkey, tmp_path) -> None:
    """The opt-out (``feedback.rateScope: tenant``): Mallory's rating trains and is counted against Mallory, and
    Alice's later rating of the same rollout is the duplicate."""
    srv = start(tmp_path, module_valkey.url, rateScope="tenant")
    try:
        record = served_to_alice(r, keys, tokenizer, 4)
        reply = rate(http, srv, MALLORY, record.prompt)
        assert reply["status"] == "accepted_for_training" and reply["rollout_id"] == record.rollout_id, reply
        assert contributions(r, keys, MALLORY) == 1 and contributions(r, keys, ALICE) == 0
        assert rate(http, srv, ALICE, record.prompt)["reason"] == "rollout_already_rated"
        assert r.xlen(keys.samples) == 1
    finally:
        srv.stop()


def test_an_unknown_rate_scope_is_refused_with_the_choices(tmp_path) -> None:
    from pydantic import ValidationError

    from onlinerl.config import OnlineRLConfig

    with pytest.raises(ValidationError, match="'user' or 'tenant'"):
        OnlineRLConfig.model_validate({"feedback": {"rateScope": "team"}})
