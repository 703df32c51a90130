"""Silence is learnable, end to end: an unreported served rollout turns into exactly one silence sample after the
window. Real valkey, real vLLM on CPU (tiny random model), the real gateway (its record script marks the rollout due)
and the real feedback service (its sweeper settles it); completions and outcomes go through the Continue-like
client (onlinerl/loop/continue_client.py). Tick-by-tick rules of the sweeper: test_silence_sweeper.py.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import redis

from onlinerl.fim import get_template
from onlinerl.keys import Keys, prompt_digest
from onlinerl.loop.continue_client import CompletionResult, ContinueClient
from onlinerl.procs import wait_for
from onlinerl.schemas import RolloutRecord

from .conftest import JOB, KEYS, FeedbackServer, stream_entries
from .gateway_stack import gateway_and_feedback

pytestmark = pytest.mark.vllm

QWEN = get_template("qwen")
EVAL_KEY = "key-acme-eval"
WINDOW = 4.0  # seconds; Continue's is 10 (the default 15 covers it), shortened so the test runs in seconds
SILENCE = {"windowSeconds": WINDOW, "sweepIntervalSeconds": 0.2, "tenants": {"acme": True, "globex": False}}
WAIT = WINDOW + 30  # generous on a loaded 2-core machine: a deadline, not a sleep


@dataclass
class Stack:
    user: ContinueClient
    evaluator: ContinueClient
    other: ContinueClient  # tenant globex: its clients do not track, silence off
    redis: redis.Redis
    keys: Keys
    feedback: FeedbackServer


@pytest.fixture(scope="module")
def stack(module_valkey, tmp_path_factory, tiny_lora_engine) -> Iterator[Stack]:
    tenants = {"acme": [*KEYS["acme"], {"key": EVAL_KEY, "role": "eval"}], "globex": KEYS["globex"]}
    tmp = tmp_path_factory.mktemp("gw")
    r = redis.Redis.from_url(module_valkey.url)
    try:
        with gateway_and_feedback(tmp, module_valkey.url, tiny_lora_engine, tenants, silence=SILENCE) as ep:
            client = functools.partial(
                ContinueClient, ep.api, ep.track, model="onlinerl-base", template=QWEN, max_tokens=8
            )
            user = client(KEYS["acme"][0], "acme")
            evaluator = client(EVAL_KEY, "acme")
            other = client(KEYS["globex"][0], "globex")
            yield Stack(user, evaluator, other, r, Keys(JOB), ep.feedback)
    finally:
        r.close()


async def _complete(client: ContinueClient, prompt: str, pin: int | None = None) -> CompletionResult:
    async with httpx.AsyncClient(timeout=120) as http:
        res = await client.complete(http, prompt, pin_version=pin)
    assert res.status == 200 and not res.error, res.error
    return res


def served_once(s: Stack, client: ContinueClient, name: str, pin: int | None = None) -> RolloutRecord:
    """One request, whatever it says (an empty completion is a legitimate action too); the gateway's record of it."""
    prompt = QWEN.render(f"{name} = ", "\n")
    asyncio.run(_complete(client, prompt, pin))
    (raw,) = s.redis.hvals(s.keys.rollouts(client.project, prompt))
    return RolloutRecord.model_validate_json(raw)


def served_shown(s: Stack, name: str) -> tuple[RolloutRecord, CompletionResult]:
    """A completion that shows something (the tiny random model says only whitespace for some prompts)."""
    for i in range(20):
        prompt = QWEN.render(f"{name}_{i} = ", "\n")
        res = asyncio.run(_complete(s.user, prompt))
        if res.text.strip():
            (raw,) = s.redis.hvals(s.keys.rollouts("acme", prompt))
            return RolloutRecord.model_validate_json(raw), res
    raise AssertionError(f"no non-empty completion for {name!r}")


def post(s: Stack, rec: RolloutRecord, res: CompletionResult, accepted: bool) -> dict:
    body = s.user.outcome(
        prompt=rec.prompt, prefix="", suffix="", filepath="a.py", shown=res.text, accepted=accepted, latency_ms=1.0
    )

    async def go() -> tuple[int, dict]:
        async with httpx.AsyncClient(timeout=60) as http:
            return await s.user.post_outcome(http, body)

    code, reply = asyncio.run(go())
    assert code == 200, reply
    return reply


def for_rollout(s: Stack, stream: str, rollout_id: str) -> list[dict]:
    return [e for e in stream_entries(s.redis, stream) if e.get("rollout_id") == rollout_id]


def settled(s: Stack, rec: RolloutRecord) -> bool:
    """The sweeper took this rollout's due entry (whatever it decided)."""
    member = f"{prompt_digest(rec.prompt)} {rec.rollout_id}"
    return s.redis.zscore(s.keys.silence_due(rec.tenant), member) is None


def metric(s: Stack, result: str) -> float:
    text = httpx.get(s.feedback.url + "/metrics").text
    line = f'onlinerl_feedback_silence_total{{result="{result}"}} '
    return float(next(x for x in text.splitlines() if x.startswith(line)).split()[-1])


def test_an_unreported_served_rollout_turns_into_exactly_one_silence_sample_after_the_window(stack):
    s = stack
    trained_before = metric(s, "trained")
    rec = served_once(s, s.user, "silent_one")
    assert rec.tenant == "acme" and rec.finished_at is not None
    assert not settled(s, rec)  # the gateway's record script marked it due, with the record

    wait_for(lambda: for_rollout(s, s.keys.samples, rec.rollout_id), WAIT, what="the silence sample")
    wait_for(lambda: settled(s, rec), WAIT, what="the due entry removed")
    (sample,) = for_rollout(s, s.keys.samples, rec.rollout_id)
    assert sample["feedback_at"] >= rec.finished_at + WINDOW  # not before the client's window closed
    assert sample["event_id"] == f"silence:{rec.rollout_id}"
    assert (sample["reward"], sample["accepted"], sample["match"], sample["shown_text"]) == (0.0, False, "silence", "")
    assert sample["completion_token_ids"] == rec.completion_token_ids  # the whole generation: its decision to say it
    assert sample["behaviour_logprobs"] == rec.behaviour_logprobs
    assert sample["prompt_token_ids"] == rec.prompt_token_ids
    assert sample["temperature"] == (rec.sampling.temperature or 1.0)
    mark = s.redis.hget(s.keys.rollouts("acme", rec.prompt), s.keys.rated_field(rec.rollout_id)).decode()
    assert mark.startswith("silent ")
    assert int(s.redis.hget(s.keys.stats(rec.policy_version, rec.arm), "silent")) >= 1
    assert metric(s, "trained") >= trained_before + 1

    # An evaluation's rollout is settled too, but only audited and counted under its own arm.
    ev = served_once(s, s.evaluator, "silent_eval", pin=0)
    assert ev.arm == "eval"
    wait_for(lambda: for_rollout(s, s.keys.audit, ev.rollout_id), WAIT, what="the eval rollout's silence audit")
    (audit,) = for_rollout(s, s.keys.audit, ev.rollout_id)
    assert (audit["outcome"], audit["reason"]) == ("silent", "eval_arm")
    assert for_rollout(s, s.keys.samples, ev.rollout_id) == []
    assert int(s.redis.hget(s.keys.stats(0, "eval"), "silent")) == 1


def test_rated_before_the_window_no_silence_and_rated_after_it_a_duplicate(stack):
    s = stack
    rated, res = served_shown(s, "rated_early")
    early = post(s, rated, res, accepted=False)
    assert (early["status"], early["rollout_id"]) == ("accepted_for_training", rated.rollout_id)

    late, late_res = served_shown(s, "rated_late")
    wait_for(lambda: for_rollout(s, s.keys.samples, late.rollout_id), WAIT, what="the late rollout's silence")
    (silence,) = for_rollout(s, s.keys.samples, late.rollout_id)
    reply = post(s, late, late_res, accepted=True)  # Continue's outcome, after the window
    assert (reply["status"], reply["reason"], reply["first_outcome"]) == (
        "duplicate",
        "rollout_already_rated",
        "silent",
    )
    (sample_id,) = [
        i.decode() for i, f in s.redis.xrange(s.keys.samples) if b"silence:" + late.rollout_id.encode() in f[b"data"]
    ]
    assert reply["entry_id"] == sample_id
    assert for_rollout(s, s.keys.samples, late.rollout_id) == [silence]  # the late accept trained nothing

    # The early one finished before the late one, so its due entry was swept first: skipped, no silence sample.
    wait_for(lambda: settled(s, rated), WAIT, what="the rated rollout's due entry")
    (only,) = for_rollout(s, s.keys.samples, rated.rollout_id)
    assert (only["reward"], only["match"]) == (-0.25, "exact")
    assert metric(s, "rated") >= 1


def test_a_tenant_with_tracking_off_gets_no_silence(stack):
    s = stack
    off = served_once(s, s.other, "globex_silent")
    assert off.tenant == "globex"
    assert not s.redis.exists(s.keys.silence_due("globex"))  # the gateway marked nothing due
    after = served_once(s, s.user, "acme_after_globex")  # finished later: once it is silenced, globex's window is over
    wait_for(lambda: for_rollout(s, s.keys.samples, after.rollout_id), WAIT, what="acme's silence sample")
    assert [e for e in stream_entries(s.redis, s.keys.samples) if e["tenant"] == "globex"] == []
    assert s.redis.hget(s.keys.rollouts("globex", off.prompt), s.keys.rated_field(off.rollout_id)) is None
