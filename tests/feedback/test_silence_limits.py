"""A silence outcome is produced by the server, not by a user: it never counts against a user's contribution limit
(issue 17) nor against its accept-rate statistics. The real feedback service (own process, its own sweeper) against a
real valkey; rollout records written by the gateway's own store (capture.RolloutStore, the record script).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator

import httpx
import pytest
import redis
from redis.asyncio import Redis as AsyncRedis

from onlinerl.auth import KeyRing
from onlinerl.config import SilenceConfig
from onlinerl.fim import get_template
from onlinerl.keys import Keys
from onlinerl.procs import wait_for
from onlinerl.schemas import RolloutRecord
from onlinerl_feedback.limits import user_of
from onlinerl_serving.capture import RolloutStore

from .conftest import KEYS, FeedbackServer, event, headers, start_feedback, stream_entries
from .rollouts import make_rollout

SUBMIT = "/api/training/submit"
TEXT = "    return a * b"
LIMIT = 2
SILENCE = {"windowSeconds": 3.0, "sweepIntervalSeconds": 0.2, "tenants": {"acme": True}}
KEY = KEYS["acme"][0]


def prompt(i: int, kind: str) -> str:
    return get_template("qwen").render(f"def mul_{kind}_{i}(a, b):\n", "\n")


def user() -> str:
    ring = KeyRing.from_mapping({"tenants": {t: {"keys": ks} for t, ks in KEYS.items()}})
    identity = ring.identity_for(KEY)
    assert identity is not None
    return user_of(identity.key_id)


@pytest.fixture
def server(module_valkey, tmp_path) -> Iterator[FeedbackServer]:
    srv = start_feedback(
        tmp_path, module_valkey.url, limits={"maxSamplesPerUserPerHour": LIMIT, "anomalyK": 0}, silence=SILENCE
    )
    try:
        yield srv
    finally:
        srv.stop()


def serve(module_valkey, keys: Keys, tokenizer, kind: str, n: int, finished_ago: float = 0.0) -> list[RolloutRecord]:
    """``n`` completions served to acme, recorded as the gateway does (marked due: acme tracks silence)."""
    recs = [
        make_rollout(tokenizer, tenant="acme", prompt=prompt(i, kind), completion=TEXT, version=1, arm="candidate")
        for i in range(n)
    ]
    for x in recs:
        x.finished_at = time.time() - finished_ago

    async def go() -> None:
        client = AsyncRedis.from_url(module_valkey.url)
        store = RolloutStore(client, keys, 1800, SilenceConfig.model_validate(SILENCE))
        try:
            for x in recs:
                await store.store(x)
        finally:
            await store.close()
            await client.aclose()

    asyncio.run(go())
    return recs


def silences(r: redis.Redis, keys: Keys) -> list[str]:
    return [s["event_id"] for s in stream_entries(r, keys.samples) if s["event_id"].startswith("silence:")]


def limited_metric(http: httpx.Client, srv: FeedbackServer) -> float:
    text = http.get(srv.url + "/metrics").text
    m = re.search(r'^onlinerl_feedback_contribution_limited_total\{tenant="acme"\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def rate(http: httpx.Client, srv: FeedbackServer, rec: RolloutRecord) -> dict:
    resp = http.post(srv.url + SUBMIT, json=event(rec.prompt, TEXT, accepted=True), headers=headers("acme", KEY))
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_silence_samples_do_not_count_against_a_users_limit(server, module_valkey, r, keys, http, tokenizer):
    me = user()
    hour_keys = keys.contrib("acme", me, 0)[:-1] + "*"
    # Four rollouts the user never reported: the service's own sweeper turns each into a silence sample.
    quiet = serve(module_valkey, keys, tokenizer, "quiet", 4, finished_ago=10)
    wait_for(lambda: len(silences(r, keys)) == 4, 30, what="four silence samples")
    assert sorted(silences(r, keys)) == sorted(f"silence:{x.rollout_id}" for x in quiet)
    assert r.keys(hour_keys) == []  # no contribution counted for the user
    assert r.exists(keys.user_stats("acme", me), keys.user_stats("acme")) == 0  # nor accept-rate statistics

    # The user's own budget is untouched: LIMIT real outcomes train, the next one is over the limit.
    rated = serve(module_valkey, keys, tokenizer, "rated", LIMIT + 1)
    replies = [rate(http, server, x) for x in rated]
    assert [x["status"] for x in replies] == ["accepted_for_training"] * LIMIT + ["rejected"]
    assert replies[-1]["reason"] == "contribution_limit"
    (window,) = r.keys(hour_keys)
    assert r.get(window) == str(LIMIT + 1).encode()  # only the user's own events counted
    assert int(r.hget(keys.user_stats("acme", me), "shown")) == LIMIT  # silences are not "shown"

    # Over its limit, the user's unreported rollouts still settle as silence (server-made), and still count nothing.
    later = serve(module_valkey, keys, tokenizer, "later", 3, finished_ago=10)
    wait_for(lambda: len(silences(r, keys)) == 4 + 3, 30, what="three more silence samples")
    assert r.get(window) == str(LIMIT + 1).encode()
    assert int(r.hget(keys.user_stats("acme", me), "shown")) == LIMIT
    assert limited_metric(http, server) == 1
    assert {f"silence:{x.rollout_id}" for x in later} <= set(silences(r, keys))
    # The rated ones never became silence as well: one outcome per rollout.
    assert not {f"silence:{x.rollout_id}" for x in rated} & set(silences(r, keys))
