"""One sample per served rollout, cache hits and eval traffic never trained: through the REAL gateway and vLLM.

Real valkey, real vLLM on CPU (tiny random model), real gateway and feedback processes; completions are requested and
rated by the Continue-like client (onlinerl/loop/continue_client.py), so the rollout records are the gateway's own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import redis

from onlinerl.fim import get_template
from onlinerl.keys import Keys
from onlinerl.loop.continue_client import CompletionResult, ContinueClient

from .conftest import JOB, KEYS, FeedbackServer, stream_entries
from .gateway_stack import gateway_and_feedback

pytestmark = pytest.mark.vllm

QWEN = get_template("qwen")
EVAL_KEY = "key-acme-eval"


@dataclass
class Stack:
    user: ContinueClient
    evaluator: ContinueClient
    redis: redis.Redis
    keys: Keys
    feedback: FeedbackServer


@pytest.fixture(scope="module")
def stack(module_valkey, tmp_path_factory, tiny_lora_engine) -> Iterator[Stack]:
    tenants = {"acme": [*KEYS["acme"], {"key": EVAL_KEY, "role": "eval"}]}
    r = redis.Redis.from_url(module_valkey.url)
    try:
        with gateway_and_feedback(tmp_path_factory.mktemp("gw"), module_valkey.url, tiny_lora_engine, tenants) as ep:
            user = ContinueClient(ep.api, ep.track, KEYS["acme"][0], "acme", "onlinerl-base", QWEN, max_tokens=8)
            evaluator = ContinueClient(ep.api, ep.track, EVAL_KEY, "acme", "onlinerl-base", QWEN, max_tokens=8)
            yield Stack(user, evaluator, r, Keys(JOB), ep.feedback)
    finally:
        r.close()


async def serve(client: ContinueClient, prefix: str, pin: int | None = None) -> tuple[str, CompletionResult]:
    """One completion that shows something (the tiny random model may say only whitespace for some prompts)."""
    async with httpx.AsyncClient(timeout=120) as http:
        for i in range(20):
            prompt = QWEN.render(f"{prefix}_{i} = ", "\n")
            res = await client.complete(http, prompt, pin_version=pin)
            assert res.status == 200 and not res.error, res.error
            if res.text.strip():
                return prompt, res
    raise AssertionError(f"no non-empty completion for {prefix!r}")


def outcome(client: ContinueClient, prompt: str, res: CompletionResult, accepted: bool = True, **extra) -> dict:
    body = client.outcome(
        prompt=prompt, prefix="", suffix="", filepath="a.py", shown=res.text, accepted=accepted, latency_ms=1.0
    )
    return {**body, **extra}


async def post_all(client: ContinueClient, bodies: list[dict], concurrent: bool) -> list[dict]:
    async with httpx.AsyncClient(timeout=60) as http:
        if concurrent:
            results = await asyncio.gather(*(client.post_outcome(http, b) for b in bodies))
        else:
            results = [await client.post_outcome(http, b) for b in bodies]
    assert all(code == 200 for code, _ in results), results
    return [reply for _, reply in results]


def counted(s: Stack, version: int, arm: str) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in s.redis.hgetall(s.keys.stats(version, arm)).items()}


def test_one_rollout_rated_five_times_then_concurrently_yields_one_sample_each(stack):
    s = stack
    prompt, res = asyncio.run(serve(s.user, "alpha"))
    assert res.version == 0
    bodies = [outcome(s.user, prompt, res) for _ in range(5)]
    replies = asyncio.run(post_all(s.user, bodies, concurrent=False))
    assert replies[0]["status"] == "accepted_for_training", replies[0]
    assert [x["status"] for x in replies[1:]] == ["duplicate"] * 4
    assert {x["reason"] for x in replies[1:]} == {"rollout_already_rated"}
    assert {x["entry_id"] for x in replies[1:]} == {replies[0]["sample_id"]}
    samples = stream_entries(s.redis, s.keys.samples)
    assert [x["event_id"] for x in samples] == [bodies[0]["completionId"]]
    audit = stream_entries(s.redis, s.keys.audit)
    assert sorted(a["event_id"] for a in audit) == sorted(b["completionId"] for b in bodies[1:])
    n = len(res.text)
    stats = counted(s, 0, "stable")
    assert {k: stats.get(k) for k in ("shown", "accepted", "shown_chars", "accepted_chars")} == {
        "shown": 1,
        "accepted": 1,
        "shown_chars": n,
        "accepted_chars": n,
    }

    # The same, all five at once: the rated check is atomic with the append.
    prompt2, res2 = asyncio.run(serve(s.user, "beta"))
    bodies2 = [outcome(s.user, prompt2, res2, accepted=False) for _ in range(5)]
    replies2 = asyncio.run(post_all(s.user, bodies2, concurrent=True))
    assert sorted(x["status"] for x in replies2) == ["accepted_for_training"] + ["duplicate"] * 4, replies2
    samples = stream_entries(s.redis, s.keys.samples)
    assert len(samples) == 2 and samples[1]["rollout_id"] == replies2[0]["rollout_id"]
    assert len(stream_entries(s.redis, s.keys.audit)) == 8
    stats = counted(s, 0, "stable")
    assert (stats["shown"], stats["rejected"], stats["shown_chars"], stats["accepted_chars"]) == (
        2,
        1,
        n + len(res2.text),
        n,
    )
    assert counted(s, 0, res.arm)["served"] >= 2  # the gateway's count: every completion served, shown or not


def test_cache_hit_and_eval_rollouts_are_never_trained(stack):
    s = stack
    before = len(stream_entries(s.redis, s.keys.samples))
    prompt, res = asyncio.run(serve(s.user, "gamma"))
    (hit,) = asyncio.run(post_all(s.user, [outcome(s.user, prompt, res, cacheHit=True)], concurrent=False))
    assert (hit["status"], hit["reason"]) == ("rejected", "cache_hit")

    prompt_e, res_e = asyncio.run(serve(s.evaluator, "delta", pin=0))  # X-OnlineRL-Version: 0
    assert (res_e.version, res_e.arm) == (0, "eval")
    # the evaluator rates what it was served (feedback.rateScope: a key rates only its own rollouts)
    (ev,) = asyncio.run(post_all(s.evaluator, [outcome(s.evaluator, prompt_e, res_e)], concurrent=False))
    assert (ev["status"], ev["reason"]) == ("rejected", "eval_arm")
    assert len(stream_entries(s.redis, s.keys.samples)) == before  # neither was trained
    reasons = [(a["outcome"], a["reason"]) for a in stream_entries(s.redis, s.keys.audit)[-2:]]
    assert reasons == [("rejected", "cache_hit"), ("rejected", "eval_arm")]
    n = len(res_e.text)
    eval_stats = counted(s, 0, "eval")  # counted once, under the eval arm only
    assert {k: eval_stats.get(k) for k in ("shown", "accepted", "shown_chars", "accepted_chars")} == {
        "shown": 1,
        "accepted": 1,
        "shown_chars": n,
        "accepted_chars": n,
    }
    # The real (non cache-hit) outcome of the user's rollout still trains, once.
    (real,) = asyncio.run(post_all(s.user, [outcome(s.user, prompt, res)], concurrent=False))
    assert real["status"] == "accepted_for_training"
    assert len(stream_entries(s.redis, s.keys.samples)) == before + 1
