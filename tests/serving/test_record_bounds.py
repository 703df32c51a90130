"""Rollout records are bounded per tenant and expire one by one, through the real product: real valkey, real vLLM on
CPU (tiny random model), the real gateway (its record script) and the real feedback service (its join), completions
and outcomes sent by the Continue-like client. Script-level rules: tests/dataplane/test_rollouts.py.
"""

from __future__ import annotations

import asyncio
import functools
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis

from onlinerl.fim import get_template
from onlinerl.keys import Keys
from onlinerl.loop.continue_client import CompletionResult, ContinueClient
from onlinerl.procs import wait_for
from onlinerl.schemas import RolloutRecord
from tests.feedback.conftest import JOB, KEYS, stream_entries
from tests.feedback.gateway_stack import gateway_and_feedback

pytestmark = pytest.mark.vllm

QWEN = get_template("qwen")
CAP = 3
TTL = 1800


@dataclass
class Stack:
    acme: ContinueClient
    globex: ContinueClient
    redis: redis.Redis
    keys: Keys
    gateway: str  # the gateway's base URL (its /metrics)
    log: Path  # the gateway's log


@pytest.fixture(scope="module")
def stack(module_valkey, tmp_path_factory, tiny_lora_engine) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("bounds")
    r = redis.Redis.from_url(module_valkey.url)
    try:
        with gateway_and_feedback(
            tmp, module_valkey.url, tiny_lora_engine, KEYS, serving={"maxRecordsPerTenant": CAP}
        ) as ep:
            client = functools.partial(
                ContinueClient, ep.api, ep.track, model="onlinerl-base", template=QWEN, max_tokens=8
            )
            yield Stack(
                client(KEYS["acme"][0], "acme"),
                client(KEYS["globex"][0], "globex"),
                r,
                Keys(JOB),
                ep.api.removesuffix("/v1"),
                tmp / "gateway.log",
            )
    finally:
        r.close()


def complete(client: ContinueClient, prompt: str) -> CompletionResult:
    async def go() -> CompletionResult:
        async with httpx.AsyncClient(timeout=120) as http:
            return await client.complete(http, prompt)

    res = asyncio.run(go())
    assert res.status == 200 and not res.error, res.error  # eviction never fails the user's request
    return res


def records(s: Stack, tenant: str, prompt: str) -> dict[str, RolloutRecord]:
    raw = s.redis.hgetall(s.keys.rollouts(tenant, prompt))
    return {k.decode(): RolloutRecord.model_validate_json(v) for k, v in raw.items() if not k.startswith(b"rated:")}


def served(s: Stack, client: ContinueClient, prompt: str) -> tuple[RolloutRecord, CompletionResult]:
    """One completion, and the gateway's record of it (the newest record of that prompt)."""
    res = complete(client, prompt)
    newest = max(records(s, client.project, prompt).values(), key=lambda x: x.finished_at or 0)
    return newest, res


def evicted_metric(s: Stack, tenant: str) -> float:
    text = httpx.get(f"{s.gateway}/metrics").text
    m = re.search(rf'^onlinerl_serving_rollout_records_evicted_total{{tenant="{tenant}"}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def rate(s: Stack, rec: RolloutRecord, res: CompletionResult) -> dict:
    body = s.acme.outcome(
        prompt=rec.prompt, prefix="", suffix="", filepath="a.py", shown=res.text, accepted=True, latency_ms=1.0
    )

    async def go() -> tuple[int, dict]:
        async with httpx.AsyncClient(timeout=60) as http:
            return await s.acme.post_outcome(http, body)

    code, reply = asyncio.run(go())
    assert code == 200, reply
    return reply


def field_ttls(s: Stack, rec: RolloutRecord) -> list[int]:
    key = s.keys.rollouts(rec.tenant, rec.prompt)
    return s.redis.execute_command("HTTL", key, "FIELDS", 2, rec.rollout_id, s.keys.rated_field(rec.rollout_id))


def test_a_tenant_over_its_cap_evicts_its_oldest_and_another_tenant_keeps_its_own(stack: Stack) -> None:
    s = stack
    theirs = [served(s, s.globex, QWEN.render(f"g{i} = ", "\n"))[0] for i in range(2)]
    before = evicted_metric(s, "acme")
    prompts = [QWEN.render(f"cap_{n} = ", "\n") for n in ("a", "b", "b", "c", "d")]  # one prompt served twice
    mine = [served(s, s.acme, p)[0] for p in prompts]
    alive = [r.rollout_id in records(s, "acme", r.prompt) for r in mine]
    assert alive == [False, False, True, True, True]  # oldest first, across prompts; the same prompt's too
    assert all(r.rollout_id in records(s, "globex", r.prompt) for r in theirs)
    assert s.redis.zcard(s.keys.rollouts_index("acme")) == CAP
    # counted once Redis acknowledged the write (after the response went out): wait for it, do not assume it
    wait_for(lambda: evicted_metric(s, "acme") - before >= 2, 30, what="the eviction counter")
    assert evicted_metric(s, "acme") - before == 2 and evicted_metric(s, "globex") == 0
    assert "tenant acme is over serving.maxRecordsPerTenant" in s.log.read_text()
    ttl_a, _ = field_ttls(s, mine[-1])
    assert TTL - 60 < ttl_a <= TTL  # the record's own TTL, set by the gateway


def test_a_rated_rollout_joins_exactly_once_even_after_its_record_is_evicted(stack: Stack) -> None:
    s = stack
    for i in range(20):  # the tiny random model says only whitespace for some prompts: find one that shows text
        rec, res = served(s, s.acme, QWEN.render(f"rated_{i} = ", "\n"))
        if res.text.strip():
            break
    else:
        raise AssertionError("no non-empty completion")
    first = rate(s, rec, res)
    assert first["status"] == "accepted_for_training", first
    rec_ttl, mark_ttl = field_ttls(s, rec)
    assert 0 < rec_ttl <= TTL and rec_ttl <= mark_ttl <= TTL  # the mark has its own TTL and outlives the record
    again = rate(s, rec, res)  # the same rollout rated again (a second completionId)
    assert again["status"] == "duplicate", again
    for i in range(CAP):  # enough newer traffic to evict it
        served(s, s.acme, QWEN.render(f"after_{i} = ", "\n"))
    assert rec.rollout_id not in records(s, "acme", rec.prompt)
    late = rate(s, rec, res)  # the record is gone: nothing to join, nothing trained
    assert late["status"] != "accepted_for_training", late
    trained = [e for e in stream_entries(s.redis, s.keys.samples) if e.get("rollout_id") == rec.rollout_id]
    assert len(trained) == 1
