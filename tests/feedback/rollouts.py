"""Rollout records exactly as the gateway writes them (docs/architecture.md, RolloutRecord), for feedback tests.

Token ids come from the real SmolLM2 tokenizer; ``token_offsets`` are the char offset where each token's text
starts, computed the way a gateway does from streamed deltas (length of the text decoded so far). The EOS token
that ends a generation adds no text, so its offset is ``len(completion)``.
"""

from __future__ import annotations

import time
import uuid

import redis

from onlinerl.auth import user_hash
from onlinerl.keys import Keys
from onlinerl.schemas import RolloutRecord


def tokenize_completion(tokenizer, completion: str, eos: bool = True) -> tuple[list[int], list[int]]:
    ids = tokenizer(completion, add_special_tokens=False)["input_ids"] if completion else []
    offsets = [len(tokenizer.decode(ids[:i])) for i in range(len(ids))]
    assert tokenizer.decode(ids) == completion, "test text must round-trip through the tokenizer"
    if eos:
        ids = [*ids, tokenizer.eos_token_id]
        offsets = [*offsets, len(completion)]
    return ids, offsets


def make_rollout(
    tokenizer,
    *,
    tenant: str,
    prompt: str,
    completion: str,
    version: int = 0,
    arm: str = "stable",
    eos: bool = True,
    created_at: float | None = None,
    user_key: str | None = None,
) -> RolloutRecord:
    """A record served to ``user_key`` (default: the tenant's first key in tests/feedback/conftest.py ``KEYS``, the
    key ``headers()`` rates with), as the gateway names its user (feedback.rateScope user joins only those)."""
    from tests.feedback.conftest import KEYS

    key = user_key if user_key is not None else KEYS.get(tenant, [f"key-{tenant}"])[0]
    ids, offsets = tokenize_completion(tokenizer, completion, eos)
    return RolloutRecord(
        rollout_id=f"cmpl-{uuid.uuid4().hex[:16]}",
        tenant=tenant,
        arm=arm,
        policy_version=version,
        served_model="onlinerl-base" if version == 0 else f"local-v{version}",
        user_hash=user_hash(key),
        prompt=prompt,
        prompt_token_ids=tokenizer(prompt, add_special_tokens=False)["input_ids"],
        completion=completion,
        completion_token_ids=ids,
        behaviour_logprobs=[-0.01 * (i + 1) for i in range(len(ids))],
        token_offsets=offsets,
        finish_reason="stop",
        created_at=created_at or time.time(),
        finished_at=time.time(),
    )


def record_rollout(client: redis.Redis, keys: Keys, record: RolloutRecord, ttl: int = 1800) -> None:
    """HSET into ``rollouts:{tenant}:{digest(prompt)}`` with the TTL, as the gateway does."""
    key = keys.rollouts(record.tenant, record.prompt)
    client.hset(key, record.rollout_id, record.to_json())
    client.expire(key, ttl)
