"""Per-user contribution limits and quarantine (issue 17): the real feedback service (own process) against a real
valkey, rollout records as the gateway writes them. A user is an API key; nothing a client sends changes who it is.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest
import redis
import yaml
from redis.asyncio import Redis

from onlinerl.auth import KeyRing, write_keys_file
from onlinerl.fim import get_template
from onlinerl.keys import Keys
from onlinerl.procs import Child, python_module
from onlinerl.valkey import free_port
from onlinerl_feedback.limits import release, user_of

from .conftest import JOB, event, stream_entries
from .rollouts import make_rollout, record_rollout

SUBMIT = "/api/training/submit"
TEXT = "    return a * b"
USERS = {"acme": ["key-honest", "key-loud", "key-third"], "globex": ["key-globex"]}


def prompt(i: int, who: str) -> str:
    return get_template("qwen").render(f"def mul_{who}_{i}(a, b):\n", "\n")


def user_id(key: str) -> str:
    """The user the service counts ``key`` under (the key's id, as onlinerl.auth computes it)."""
    ring = KeyRing.from_mapping({"tenants": {t: {"keys": ks} for t, ks in USERS.items()}})
    identity = ring.identity_for(key)
    assert identity is not None
    return user_of(identity.key_id)


class Feedback:
    def __init__(self, tmp: Path, redis_url: str, limits: dict) -> None:
        keys_file = write_keys_file(tmp / "keys.yaml", USERS)
        cfg = {
            "job": JOB,
            "model": {"fimTemplate": "qwen"},
            "auth": {"apiKeysFile": str(keys_file)},
            "feedback": {"maxBodyBytes": 16384, "limits": limits},
        }
        (tmp / "config.yaml").write_text(yaml.safe_dump(cfg))
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.child = Child(
            "feedback",
            python_module("onlinerl_feedback", "--port", str(port), "--host", "127.0.0.1", "--redis-url", redis_url),
            tmp / "feedback.log",
            env={"ONLINERL_CONFIG": str(tmp / "config.yaml")},
        ).start()
        try:
            self.child.wait_healthy(f"{self.url}/healthz", timeout=60)
        except Exception:
            self.child.stop()
            raise

    def metric(self, http: httpx.Client, name: str, tenant: str = "acme") -> float:
        text = http.get(self.url + "/metrics").text
        m = re.search(rf'^{name}{{tenant="{tenant}"}} (\S+)$', text, re.M)
        return float(m.group(1)) if m else 0.0


@pytest.fixture
def limited(module_valkey, tmp_path) -> Iterator[Feedback]:
    srv = Feedback(tmp_path, module_valkey.url, {"maxSamplesPerUserPerHour": 3, "anomalyK": 0})
    try:
        yield srv
    finally:
        srv.child.stop()


@pytest.fixture
def watched(module_valkey, tmp_path) -> Iterator[Feedback]:
    srv = Feedback(tmp_path, module_valkey.url, {"anomalyK": 3, "anomalyMinShown": 10})
    try:
        yield srv
    finally:
        srv.child.stop()


def served_and_rated(
    http, srv, r, keys, tokenizer, key: str, i: int, accepted: bool = True, tenant: str = "acme", **extra
) -> dict:
    """One completion served to ``key`` (its rollout record, candidate arm of v1) and the user's verdict on it."""
    p = prompt(i, key)
    record_rollout(
        r,
        keys,
        make_rollout(tokenizer, tenant=tenant, prompt=p, completion=TEXT, version=1, arm="candidate", user_key=key),
    )
    body = event(p, TEXT, accepted=accepted, **extra)
    resp = http.post(srv.url + SUBMIT, json=body, headers={"Authorization": f"Bearer {key}", "X-Project-ID": tenant})
    assert resp.status_code == 200, resp.text
    return {**resp.json(), "_body": body}


def test_user_over_its_limit_is_audited_not_trained_not_counted(limited, r, keys, http, tokenizer):
    replies = [
        served_and_rated(http, limited, r, keys, tokenizer, "key-loud", i, uniqueId=f"inst-{i}") for i in range(6)
    ]
    assert [x["status"] for x in replies] == ["accepted_for_training"] * 3 + ["rejected"] * 3
    over = replies[3:]
    assert {x["reason"] for x in over} == {"contribution_limit"}  # a fresh uniqueId per event changes nothing
    samples = stream_entries(r, keys.samples)
    assert [s["event_id"] for s in samples] == [x["_body"]["completionId"] for x in replies[:3]]
    audit = {i.decode(): data for i, data in _audit(r, keys)}
    assert [audit[x["audit_id"]]["reason"] for x in over] == ["contribution_limit"] * 3
    assert [audit[x["audit_id"]]["event_id"] for x in over] == [x["_body"]["completionId"] for x in over]
    stats = r.hgetall(keys.stats(1, "candidate"))
    assert (int(stats[b"shown"]), int(stats[b"accepted"])) == (3, 3)  # the canary never saw the limited events
    assert limited.metric(http, "onlinerl_feedback_contribution_limited_total") == 3
    window = r.keys(keys.contrib("acme", user_id("key-loud"), 0)[:-1] + "*")
    assert len(window) == 1 and r.get(window[0]) == b"6" and 0 < r.ttl(window[0]) <= 7200

    # A replay of a limited event stays what it was: a duplicate of a rejected event, never a sample.
    replay = http.post(
        limited.url + SUBMIT,
        json=over[0]["_body"],
        headers={"Authorization": "Bearer key-loud", "X-Project-ID": "acme"},
    ).json()
    assert (replay["status"], replay["first_outcome"], replay["entry_id"]) == (
        "duplicate",
        "rejected",
        over[0]["audit_id"],
    )

    # Another key of the same tenant, and another tenant, have their own budgets.
    other = [served_and_rated(http, limited, r, keys, tokenizer, "key-honest", i) for i in range(3)]
    foreign = served_and_rated(http, limited, r, keys, tokenizer, "key-globex", 0, tenant="globex")
    assert [x["status"] for x in [*other, foreign]] == ["accepted_for_training"] * 4
    assert len(stream_entries(r, keys.samples)) == 3 + 3 + 1
    assert limited.metric(http, "onlinerl_feedback_contribution_limited_total", "globex") == 0


def test_user_accepting_far_above_the_tenant_is_quarantined_until_released(
    watched, r, keys, http, tokenizer, module_valkey
):
    # The rest of the tenant accepts 1 in 5 of its suggestions.
    for i in range(20):
        reply = served_and_rated(http, watched, r, keys, tokenizer, "key-honest", i, accepted=i % 5 == 0)
        assert reply["status"] == "accepted_for_training"
    # One key accepts everything: at its 10th rated suggestion 10/10 >> 4/20 + 3 sigma, and it is quarantined.
    replies = [served_and_rated(http, watched, r, keys, tokenizer, "key-loud", i) for i in range(14)]
    assert [x["status"] for x in replies] == ["accepted_for_training"] * 10 + ["rejected"] * 4
    assert {x["reason"] for x in replies[10:]} == {"quarantined"}
    loud = user_id("key-loud")
    assert r.get(keys.quarantine("acme", loud)) == b"accept rate 10/10 far above tenant rest 4/20"
    trained = [s["event_id"] for s in stream_entries(r, keys.samples)]
    assert len(trained) == 30 and not {x["_body"]["completionId"] for x in replies[10:]} & set(trained)
    reasons = [a["reason"] for _, a in _audit(r, keys)]
    assert reasons == ["quarantined"] * 4
    stats = r.hgetall(keys.stats(1, "candidate"))
    assert (int(stats[b"shown"]), int(stats[b"accepted"])) == (30, 14)
    assert watched.metric(http, "onlinerl_feedback_users_quarantined_total") == 1
    assert watched.metric(http, "onlinerl_feedback_quarantined_total") == 4
    # Honest users are untouched, and so is a key that accepts at the tenant's rate.
    assert served_and_rated(http, watched, r, keys, tokenizer, "key-honest", 99)["status"] == "accepted_for_training"
    assert not r.exists(keys.quarantine("acme", user_id("key-honest")))

    # An admin releases the user: its counters start afresh and its next event trains again.
    async def do_release() -> bool:
        client = Redis.from_url(module_valkey.url)
        try:
            return await release(client, keys, "acme", loud)
        finally:
            await client.aclose()

    assert asyncio.run(do_release()) is True
    after = served_and_rated(http, watched, r, keys, tokenizer, "key-loud", 100)
    assert after["status"] == "accepted_for_training"
    assert int(r.hget(keys.user_stats("acme", loud), "shown")) == 1


def _audit(r: redis.Redis, keys: Keys) -> list:
    return [(i, orjson.loads(f[b"data"])) for i, f in r.xrange(keys.audit)]
