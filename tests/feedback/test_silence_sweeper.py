"""The silence sweeper on a real valkey: records written by the gateway's own record script (capture.RolloutStore),
real ratings through the real feedback service (HTTP), the sweeper driven tick by tick with an explicit clock.

The end-to-end version (real vLLM, real gateway, the sweeper inside the feedback process) is
test_silence_through_gateway.py.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from prometheus_client import CollectorRegistry
from redis.asyncio import Redis as AsyncRedis

from onlinerl.config import ConfigError, FeedbackConfig, RewardConfig, SilenceConfig, from_mapping
from onlinerl.fim import get_template
from onlinerl.keys import prompt_digest
from onlinerl.procs import wait_for
from onlinerl.schemas import RolloutRecord, SamplingParams
from onlinerl_feedback.sweeper import SilenceSweeper, silence_counter
from onlinerl_serving.capture import RolloutStore

from .conftest import event, headers, start_feedback, stream_entries
from .rollouts import make_rollout

SUBMIT = "/api/training/submit"
QWEN = get_template("qwen")
TEXT = "    return a * b"
WINDOW = 15.0
SILENCE = SilenceConfig(window_seconds=WINDOW, tenants={"acme": True, "globex": False})


def prompt(i: int) -> str:
    return QWEN.render(f"def mul_{i}(a, b):\n", "\n")


@pytest.fixture(scope="module")
def server(module_valkey, tmp_path_factory):
    """The real service, silence off (this module's sweeps are the test's own, tick by tick)."""
    srv = start_feedback(tmp_path_factory.mktemp("feedback"), module_valkey.url)
    try:
        yield srv
    finally:
        srv.stop()


def served(module_valkey, keys, records: list[RolloutRecord], silence: SilenceConfig = SILENCE) -> None:
    """Record rollouts exactly as the gateway does (its RolloutStore and record script)."""

    async def go() -> None:
        client = AsyncRedis.from_url(module_valkey.url)
        store = RolloutStore(client, keys, 1800, silence)
        try:
            for rec in records:
                await store.store(rec)
        finally:
            await store.close()
            await client.aclose()

    asyncio.run(go())


def sweep(module_valkey, keys, now: float, cfg: FeedbackConfig | None = None, sweepers: int = 1, counter=None):
    """Run ``sweepers`` sweepers at once (replicas or workers racing on one due-set); their counts, merged."""
    cfg = cfg or FeedbackConfig(silence=SILENCE)

    async def go():
        client = AsyncRedis.from_url(module_valkey.url)
        try:
            runs = [SilenceSweeper(client, keys, cfg, counter).sweep(now) for _ in range(sweepers)]
            results = await asyncio.gather(*runs)
        finally:
            await client.aclose()
        merged: dict[str, int] = {}
        for res in results:
            for k, v in res.counts.items():
                merged[k] = merged.get(k, 0) + v
        return merged

    return asyncio.run(go())


def rollout(tokenizer, i: int = 0, tenant: str = "acme", finished: float | None = None, **kw) -> RolloutRecord:
    rec = make_rollout(tokenizer, tenant=tenant, prompt=prompt(i), completion=TEXT, **kw)
    return rec.model_copy(update={"finished_at": finished or time.time()})


def test_an_unreported_rollout_becomes_exactly_one_silence_sample_after_the_window(module_valkey, r, keys, tokenizer):
    rec = rollout(tokenizer).model_copy(update={"sampling": SamplingParams(temperature=0.7)})
    served(module_valkey, keys, [rec])
    t0 = rec.finished_at
    due = keys.silence_due("acme")
    assert r.zrange(due, 0, -1, withscores=True) == [
        (f"{prompt_digest(rec.prompt)} {rec.rollout_id}".encode(), pytest.approx(t0))
    ]
    registry = CollectorRegistry()
    counter = silence_counter(registry)

    assert sweep(module_valkey, keys, t0 + WINDOW - 0.5, counter=counter) == {}  # inside the window: nothing
    assert stream_entries(r, keys.samples) == [] and r.zcard(due) == 1

    assert sweep(module_valkey, keys, t0 + WINDOW + 0.5, counter=counter) == {"trained": 1}
    (sample,) = stream_entries(r, keys.samples)
    assert sample["event_id"] == f"silence:{rec.rollout_id}" and sample["rollout_id"] == rec.rollout_id
    assert sample["reward"] == RewardConfig().empty == 0.0
    assert sample["completion_token_ids"] == rec.completion_token_ids  # the whole generation, EOS included
    assert sample["behaviour_logprobs"] == rec.behaviour_logprobs
    assert sample["prompt_token_ids"] == rec.prompt_token_ids
    assert (sample["accepted"], sample["shown_text"], sample["match"]) == (False, "", "silence")
    assert (sample["temperature"], sample["tenant"], sample["arm"]) == (0.7, "acme", "stable")
    (entry_id,) = [i.decode() for i, _ in r.xrange(keys.samples)]
    assert r.hget(keys.rollouts("acme", rec.prompt), keys.rated_field(rec.rollout_id)) == f"silent {entry_id}".encode()
    assert r.hget(keys.stats(0, "stable"), "silent") == b"1"
    assert r.zcard(due) == 0

    assert sweep(module_valkey, keys, t0 + 10 * WINDOW, counter=counter) == {}  # never twice
    assert len(stream_entries(r, keys.samples)) == 1
    assert registry.get_sample_value("onlinerl_feedback_silence_total", {"result": "trained"}) == 1.0
    assert registry.get_sample_value("onlinerl_feedback_silence_total", {"result": "rated"}) == 0.0


def test_a_rollout_rated_before_the_window_gets_no_silence(server, module_valkey, r, keys, tokenizer, http):
    rec = rollout(tokenizer)
    served(module_valkey, keys, [rec])
    resp = http.post(server.url + SUBMIT, json=event(rec.prompt, TEXT, accepted=False), headers=headers("acme"))
    assert resp.json()["status"] == "accepted_for_training", resp.text
    assert sweep(module_valkey, keys, rec.finished_at + WINDOW + 1) == {"rated": 1}
    (sample,) = stream_entries(r, keys.samples)  # only the real reject
    assert (sample["reward"], sample["match"]) == (-0.25, "exact")
    assert r.zcard(keys.silence_due("acme")) == 0 and r.hget(keys.stats(0, "stable"), "silent") is None


def test_a_rating_after_the_silence_sample_is_a_duplicate(server, module_valkey, r, keys, tokenizer, http):
    rec = rollout(tokenizer)
    served(module_valkey, keys, [rec])
    assert sweep(module_valkey, keys, rec.finished_at + WINDOW + 1) == {"trained": 1}
    (silence_id,) = [i.decode() for i, _ in r.xrange(keys.samples)]
    late = event(rec.prompt, TEXT, accepted=True)
    reply = http.post(server.url + SUBMIT, json=late, headers=headers("acme")).json()
    assert (reply["status"], reply["reason"], reply["rollout_id"]) == (
        "duplicate",
        "rollout_already_rated",
        rec.rollout_id,
    )
    assert (reply["first_outcome"], reply["entry_id"]) == ("silent", silence_id)
    assert len(stream_entries(r, keys.samples)) == 1  # the late accept is audited, never trained
    (audit,) = stream_entries(r, keys.audit)
    assert (audit["event_id"], audit["first_outcome"]) == (late["completionId"], "silent")
    assert r.hget(keys.stats(0, "stable"), "accepted") is None  # nor counted


def test_racing_sweepers_settle_each_rollout_once(module_valkey, r, keys, tokenizer):
    now = time.time()
    recs = [rollout(tokenizer, i, finished=now - 100 + i) for i in range(30)]
    served(module_valkey, keys, recs)
    counts = sweep(module_valkey, keys, now, sweepers=3)
    assert counts["trained"] == 30 and set(counts) <= {"trained", "taken"}
    samples = stream_entries(r, keys.samples)
    assert sorted(s["rollout_id"] for s in samples) == sorted(x.rollout_id for x in recs)
    assert r.hget(keys.stats(0, "stable"), "silent") == b"30"


def test_sweeps_go_past_one_batch_in_finish_order(module_valkey, r, keys, tokenizer):
    now = time.time()
    recs = [rollout(tokenizer, i, finished=now - 50 + i) for i in range(7)]
    served(module_valkey, keys, recs)
    cfg = FeedbackConfig(silence=SilenceConfig(window_seconds=WINDOW, tenants={"acme": True}, sweep_batch=3))
    assert sweep(module_valkey, keys, now - 50 + 3 + WINDOW, cfg) == {"trained": 4}  # finished at -50..-47
    assert sweep(module_valkey, keys, now + WINDOW, cfg) == {"trained": 3}
    assert [s["rollout_id"] for s in stream_entries(r, keys.samples)] == [x.rollout_id for x in recs]


def test_tracking_off_produces_nothing(module_valkey, r, keys, tokenizer):
    off = rollout(tokenizer, 1, tenant="globex")  # listed as false
    unlisted = rollout(tokenizer, 2, tenant="initech")  # not listed: off by default
    served(module_valkey, keys, [off, unlisted])
    assert not r.exists(keys.silence_due("globex"), keys.silence_due("initech"))  # the gateway marked nothing due
    assert r.hlen(keys.rollouts("globex", off.prompt)) == 1  # but recorded the rollout as always
    # Hostile: a due entry planted for an untracked tenant is never swept.
    r.zadd(keys.silence_due("globex"), {f"{prompt_digest(off.prompt)} {off.rollout_id}": 1.0})
    assert sweep(module_valkey, keys, time.time() + 10 * WINDOW) == {}
    assert stream_entries(r, keys.samples) == [] and r.zcard(keys.silence_due("globex")) == 1
    assert FeedbackConfig().silence.tenants == {} and not FeedbackConfig().silence.tracked("acme")  # default: off


def test_eval_greedy_and_tokenless_rollouts_are_audited_counted_never_trained(module_valkey, r, keys, tokenizer):
    ev = rollout(tokenizer, 1, arm="eval")
    greedy = rollout(tokenizer, 2).model_copy(update={"sampling": SamplingParams(temperature=0.0)})
    empty = rollout(tokenizer, 3).model_copy(update={"completion_token_ids": [], "behaviour_logprobs": []})
    served(module_valkey, keys, [ev, greedy, empty])
    assert sweep(module_valkey, keys, time.time() + WINDOW + 1) == {"audited": 3}
    assert stream_entries(r, keys.samples) == []
    audit = {a["rollout_id"]: a for a in stream_entries(r, keys.audit)}
    assert {rid: (a["outcome"], a["reason"]) for rid, a in audit.items()} == {
        ev.rollout_id: ("silent", "eval_arm"),
        greedy.rollout_id: ("silent", "greedy_sampling"),
        empty.rollout_id: ("silent", "no_tokens"),
    }
    assert r.hget(keys.stats(0, "eval"), "silent") == b"1"  # under the eval arm only
    assert r.hget(keys.stats(0, "stable"), "silent") == b"2"
    for rec in (ev, greedy, empty):  # rated: a late outcome is a duplicate
        assert r.hget(keys.rollouts("acme", rec.prompt), keys.rated_field(rec.rollout_id)).startswith(b"silent ")


def test_expired_forged_and_foreign_due_entries_are_dropped_not_trained(module_valkey, r, keys, tokenizer):
    gone, theirs = rollout(tokenizer, 1), rollout(tokenizer, 2, tenant="globex")
    served(module_valkey, keys, [gone, theirs])
    r.delete(keys.rollouts("acme", gone.prompt))  # the record expired
    due = keys.silence_due("acme")
    # Forged: not "<digest> <rollout_id>"; and another tenant's rollout planted in acme's due-set.
    r.zadd(due, {"garbage": 1.0, "a b c": 2.0, f"{prompt_digest(theirs.prompt)} {theirs.rollout_id}": 3.0})
    counts = sweep(module_valkey, keys, time.time() + WINDOW + 1)
    assert counts == {"expired": 2, "invalid": 2}  # acme's lookup never reads globex's hash
    assert stream_entries(r, keys.samples) == [] and stream_entries(r, keys.audit) == []
    assert r.zcard(due) == 0
    assert not r.hexists(keys.rollouts("globex", theirs.prompt), keys.rated_field(theirs.rollout_id))


def test_the_due_set_stays_bounded_without_a_sweeper(module_valkey, r, keys, tokenizer):
    now = time.time()
    old = rollout(tokenizer, 1, finished=now - 1801)  # older than the records' TTL: its record is gone by now
    new = rollout(tokenizer, 2, finished=now)
    served(module_valkey, keys, [old, new])
    due = keys.silence_due("acme")
    assert [m.decode().split()[1] for m in r.zrange(due, 0, -1)] == [new.rollout_id]
    assert 1790 <= r.ttl(due) <= 1800


@pytest.mark.parametrize(
    ("silence", "field"),
    [
        ({"windowSeconds": 0}, "feedback.silence.windowSeconds"),
        ({"windowSeconds": 10_000}, "feedback.silence.windowSeconds"),
        ({"tenants": {"acme": "sometimes"}}, "feedback.silence.tenants.acme"),
        ({"tenant": {"acme": True}}, "feedback.silence.tenant"),
        ({"sweepBatch": 0}, "feedback.silence.sweepBatch"),
    ],
)
def test_bad_silence_config_names_the_field(silence, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        from_mapping({"feedback": {"silence": silence}})


def test_the_feedback_service_sweeps_by_itself(module_valkey, r, keys, tokenizer, tmp_path):
    """The sweeper runs inside the service for tracked tenants; its figures are on /metrics."""
    fb = start_feedback(
        tmp_path,
        module_valkey.url,
        silence={"windowSeconds": 0.5, "sweepIntervalSeconds": 0.1, "tenants": {"acme": True}},
    )
    try:
        rec = rollout(tokenizer)
        served(module_valkey, keys, [rec])
        wait_for(lambda: stream_entries(r, keys.samples), 20, what="the service's silence sample")
        (sample,) = stream_entries(r, keys.samples)
        assert sample["event_id"] == f"silence:{rec.rollout_id}"
        metrics = httpx.get(fb.url + "/metrics").text
        assert 'onlinerl_feedback_silence_total{result="trained"} 1.0' in metrics
    finally:
        fb.stop()
