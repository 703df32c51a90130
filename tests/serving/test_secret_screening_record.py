"""The gateway's record path with a credential in the completion (issue 38), run through the gateway's own objects
on the session's real valkey: the tiny random model cannot be made to write a GitHub token, so the completion is
fed to the gateway's own accumulator as vLLM would stream it, and ``Gateway._start_record`` writes it (the function
that runs before ``data: [DONE]``). The record holds neither text nor tokens, only the finding; feedback's own
decision on the real record audits the accept ``secret_detected`` (the event holding the token, or a shown prefix
without it); no Redis key or value holds the token. Also ``block`` mode: a prompt holding a key is refused with a
400 that names the finding's kind and position, never its text, before anything is recorded or generated.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import httpx
import orjson
import redis

from onlinerl.arms import STABLE
from onlinerl.auth import KeyRing, user_hash
from onlinerl.config import from_mapping
from onlinerl.keys import Keys
from onlinerl.redisconn import connect_async
from onlinerl.schemas import CompletionOutcome, RolloutRecord
from onlinerl.secret_scan import scan_fields
from onlinerl.valkey import EmbeddedValkey
from onlinerl_feedback.decide import SECRET_DETECTED, decide
from onlinerl_serving.capture import RolloutAccumulator
from onlinerl_serving.gateway import Gateway, _Ctx
from onlinerl_serving.requests import parse_completion_request
from onlinerl_serving.routing import Route
from onlinerl_serving.upstream import EnginePool
from tests.privacy_corpus import every_value, fake_aws_key_id, fake_github_token

JOB = "secrets"
KEY = "key-acme-1"
TOKEN = fake_github_token(3)
AWS = fake_aws_key_id(3)
PROMPT = "import requests\n\ndef fetch(url):\n    headers = {'Authorization': "
COMPLETION = f'"token {TOKEN}"}}\n    return requests.get(url, headers=headers)'


def gateway(url: str, mode: str = "audit") -> Gateway:
    cfg = from_mapping({"job": JOB, "redis": {"url": url}, "privacy": {"secretScreening": mode}})
    ring = KeyRing.from_mapping({"tenants": {"acme": {"keys": [KEY]}}})
    return Gateway(
        cfg,
        ring,
        connect_async(cfg.redis, url),
        EnginePool.from_url("http://127.0.0.1:9", connect_timeout=1, read_timeout=1),
    )


def as_vllm_streams(acc: RolloutAccumulator) -> None:
    """The completion in two stream chunks, the token split across them (as a stream_interval would)."""
    half = len(COMPLETION) // 2
    acc.add_choice(
        {
            "text": COMPLETION[:half],
            "prompt_token_ids": [1, 2, 3],
            "token_ids": [10, 11],
            "logprobs": {"token_logprobs": [-0.5, -0.7], "text_offset": [0, 5]},
        }
    )
    acc.add_choice(
        {
            "text": COMPLETION[half:],
            "token_ids": [12, 13],
            "logprobs": {"token_logprobs": [-0.2, -0.1], "text_offset": [9, 20]},
            "finish_reason": "stop",
        }
    )


async def record_through_the_gateway(url: str) -> str:
    gw = gateway(url)
    try:
        body = orjson.dumps({"prompt": PROMPT, "max_tokens": 16, "stream": True})
        req = parse_completion_request(body, gw.limits)
        rid = uuid.uuid4().hex
        ctx = _Ctx(req, "acme", user_hash(KEY), Route(STABLE, 0, 0), "onlinerl-base", rid, time.time(), 0.0, 0.0)
        acc = RolloutAccumulator()
        as_vllm_streams(acc)
        assert TOKEN in acc.completion
        await (await gw._start_record(ctx, acc))
        exported = gw.metrics.registry.get_sample_value(
            "onlinerl_serving_secret_findings_total", {"kind": "github_token", "field": "completion"}
        )
        assert exported == 1
        return rid
    finally:
        await gw.rollouts.close()
        await gw.redis.aclose()


def test_a_token_in_the_completion_is_recorded_without_the_text_and_never_trained(
    empty_valkey: EmbeddedValkey, redis_client: redis.Redis
) -> None:
    rid = asyncio.run(record_through_the_gateway(empty_valkey.url))
    keys = Keys(JOB)
    raw = redis_client.hget(keys.rollouts("acme", PROMPT), rid)  # filed under the served prompt's digest
    assert raw is not None
    record = RolloutRecord.model_validate_json(raw)
    assert record.redacted and (record.prompt, record.completion) == ("", "")
    assert record.completion_token_ids == record.behaviour_logprobs == record.prompt_token_ids == []
    [finding] = record.secrets
    assert (finding.field, finding.kind) == ("completion", "github_token")
    assert COMPLETION[finding.start : finding.end] == TOKEN
    for value in every_value(redis_client):
        assert TOKEN.encode() not in value

    cfg = from_mapping({}).feedback
    # the accept of the whole completion: the event itself holds the token
    full = CompletionOutcome.model_validate({"completionId": "c1", "accepted": True, "completion": COMPLETION})
    found = scan_fields([("prompt", PROMPT), ("completion", full.completion)])
    decided = decide(full, "acme", PROMPT, [record], cfg, rater=user_hash(KEY), secrets=found, sender=user_hash(KEY))
    assert (decided.status, decided.reason, decided.to_samples, decided.rates) == (
        "rejected",
        SECRET_DETECTED,
        False,
        rid,
    )
    assert TOKEN.encode() not in decided.entry and decided.counters == ()
    # Continue showed only the text before the token: nothing to join in clear, the rollout's finding decides
    cut = COMPLETION[: COMPLETION.index("ghp_")]
    prefix = CompletionOutcome.model_validate({"completionId": "c2", "accepted": True, "completion": cut})
    decided = decide(prefix, "acme", PROMPT, [record], cfg, rater=user_hash(KEY))
    assert (decided.reason, decided.to_samples, decided.rates) == (SECRET_DETECTED, False, rid)
    assert [f["kind"] for f in decided.details["findings"]] == ["github_token"]


def test_block_mode_refuses_a_prompt_with_a_key_naming_where_not_what(
    empty_valkey: EmbeddedValkey, redis_client: redis.Redis
) -> None:
    async def post(prompt: str) -> httpx.Response:
        gw = gateway(empty_valkey.url, "block")
        try:
            transport = httpx.ASGITransport(app=gw)
            async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
                return await http.post(
                    "/v1/completions",
                    json={"prompt": prompt, "max_tokens": 4},
                    headers={"Authorization": f"Bearer {KEY}"},
                )
        finally:
            await gw.rollouts.close()
            await gw.redis.aclose()

    prompt = f'AWS_ACCESS_KEY_ID = "{AWS}"\nclient = boto3.client('
    r = asyncio.run(post(prompt))
    assert r.status_code == 400
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("secret_in_prompt", "prompt")
    assert "aws_access_key_id in the prompt at characters 21-41" in err["message"] and AWS not in r.text
    assert prompt[21:41] == AWS
    assert redis_client.dbsize() == 0  # nothing recorded, nothing counted


def test_audit_mode_scans_the_prompt_during_the_generation_and_still_redacts_its_record(
    empty_valkey: EmbeddedValkey, redis_client: redis.Redis
) -> None:
    """Under audit the prompt is scanned by a task started with the request (SecretScreen.prescan, issue 40: off
    the user's path); the record is redacted for the prompt's finding exactly as when scanned at recording time."""
    prompt = f'AWS_ACCESS_KEY_ID = "{AWS}"\nclient = boto3.client('

    async def record() -> tuple[str, list]:
        gw = gateway(empty_valkey.url)
        try:
            assert gateway(empty_valkey.url, "block").screen.prescan(prompt) is None  # block refused it before
            body = orjson.dumps({"prompt": prompt, "max_tokens": 16, "stream": True})
            req = parse_completion_request(body, gw.limits)
            rid = uuid.uuid4().hex
            ctx = _Ctx(req, "acme", user_hash(KEY), Route(STABLE, 0, 0), "onlinerl-base", rid, time.time(), 0.0, 0.0)
            ctx.prompt_scan = gw.screen.prescan(prompt)
            assert not ctx.prompt_scan.done()  # it runs once the caller yields (its request goes to vLLM first)
            await asyncio.sleep(0.01)
            found = ctx.prompt_scan.result()
            acc = RolloutAccumulator()
            acc.add_choice(
                {
                    "text": " 'us-east-1')",
                    "prompt_token_ids": [1],
                    "token_ids": [7],
                    "finish_reason": "stop",
                    "logprobs": {"token_logprobs": [-0.3], "text_offset": [0]},
                }
            )
            await (await gw._start_record(ctx, acc))
            return rid, found
        finally:
            await gw.rollouts.close()
            await gw.redis.aclose()

    rid, found = asyncio.run(record())
    assert [(f.field, f.kind, f.start, f.end) for f in found] == [("prompt", "aws_access_key_id", 21, 41)]
    raw = redis_client.hget(Keys(JOB).rollouts("acme", prompt), rid)
    assert raw is not None
    rec = RolloutRecord.model_validate_json(raw)
    assert (
        rec.redacted
        and rec.prompt == ""
        and [(s.field, s.kind) for s in rec.secrets] == [("prompt", "aws_access_key_id")]
    )
    for value in every_value(redis_client):
        assert AWS.encode() not in value
