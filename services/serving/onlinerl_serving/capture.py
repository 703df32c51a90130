"""Rollout capture: accumulate what vLLM generated, strip what the client did not ask for, store the record.

The record's write must reach Redis before the client sees the end of the response (``data: [DONE]`` or the JSON
body), so a feedback upload, which can only follow that, always finds it. Its acknowledgement (which waits for the
AOF fsync) is awaited after the response is out.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from onlinerl.config import SilenceConfig
from onlinerl.keys import Keys, prompt_digest
from onlinerl.redis_pipe import PipelinedConnection
from onlinerl.schemas import RolloutRecord, SamplingParams

# Fields an OpenAI client expects; vLLM's extras (token_ids, stop_reason, kv_transfer_params...) never leave the pod.
_TOP_FIELDS = ("id", "object", "created", "model", "choices", "system_fingerprint", "usage")
_USAGE_FIELDS = ("prompt_tokens", "completion_tokens", "total_tokens")


@dataclass
class RolloutAccumulator:
    """Collects one choice's text, token ids, behaviour log-probs and offsets across stream chunks (or one body)."""

    prompt_token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    finish_reason: str | None = None

    def add_choice(self, choice: dict[str, Any]) -> None:
        """Fold in one choice (a stream delta or the whole non-stream choice)."""
        if choice.get("prompt_token_ids"):
            self.prompt_token_ids = list(choice["prompt_token_ids"])
        self.text.append(choice.get("text") or "")
        self.token_ids.extend(choice.get("token_ids") or ())
        lp = choice.get("logprobs")
        if lp:
            self.logprobs.extend(x if x is not None else 0.0 for x in lp.get("token_logprobs") or ())
            self.offsets.extend(lp.get("text_offset") or ())
        if choice.get("finish_reason"):
            self.finish_reason = choice["finish_reason"]

    @property
    def completion(self) -> str:
        return "".join(self.text)

    def consistent(self) -> bool:
        """One log-prob and one offset per generated token (vLLM's contract; checked, not assumed)."""
        return len(self.token_ids) == len(self.logprobs) == len(self.offsets)

    def to_record(
        self,
        *,
        tenant: str,
        arm: str,
        version: int,
        served_model: str,
        user_hash: str,
        prompt: str,
        sampling: dict[str, Any],
        created_at: float,
        rollout_id: str | None = None,
    ) -> RolloutRecord:
        return RolloutRecord(
            rollout_id=rollout_id or uuid.uuid4().hex,
            tenant=tenant,
            arm=arm,
            policy_version=version,
            served_model=served_model,
            user_hash=user_hash,
            prompt=prompt,
            prompt_token_ids=self.prompt_token_ids,
            completion=self.completion,
            completion_token_ids=self.token_ids,
            behaviour_logprobs=self.logprobs,
            token_offsets=self.offsets,
            finish_reason=self.finish_reason,
            sampling=SamplingParams(**sampling),
            created_at=created_at,
            finished_at=time.time(),
        )


def client_view(payload: dict[str, Any], *, logprobs: int | None, token_ids: bool) -> dict[str, Any]:
    """The response (or stream chunk) as the client asked for it: OpenAI fields only, log-probs only if requested."""
    out = {k: payload[k] for k in _TOP_FIELDS if k in payload and payload[k] is not None}
    choices = []
    for ch in payload.get("choices") or ():
        c: dict[str, Any] = {"index": ch.get("index", 0), "text": ch.get("text", "")}
        if logprobs is not None:
            c["logprobs"] = ch.get("logprobs")
        if token_ids:
            if ch.get("prompt_token_ids") is not None:
                c["prompt_token_ids"] = ch["prompt_token_ids"]
            c["token_ids"] = ch.get("token_ids")
        c["finish_reason"] = ch.get("finish_reason")
        choices.append(c)
    out["choices"] = choices
    if isinstance(out.get("usage"), dict):
        out["usage"] = {k: out["usage"][k] for k in _USAGE_FIELDS if k in out["usage"]}
    return out


# HSET the record, refresh the hash's TTL, count it as served: one atomic command, one round trip. Every key carries
# the job's hash tag, so this also runs on Redis Cluster. For a tenant with silence tracking on (KEYS[3] given), the
# rollout also joins the tenant's due-set, scored by its finish time, in the same step: a rollout a client can rate is
# always one the silence sweeper will find. Entries older than the records' TTL are dropped (their records are gone)
# so the set stays bounded even when no sweeper runs; the set itself expires with the last record.
# KEYS: rollouts hash, stats, [silence due-set]. ARGV: rollout_id, record json, ttl, [member, finished_at, cut-off].
_STORE_ROLLOUT = """
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[3])
if #KEYS >= 3 then
  redis.call('ZADD', KEYS[3], ARGV[5], ARGV[4])
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', '(' .. ARGV[6])
  redis.call('EXPIRE', KEYS[3], ARGV[3])
end
return redis.call('HINCRBY', KEYS[2], 'served', 1)
"""


class RolloutStore:
    """Writes rollout records on a pipelined connection, so a write can be on the wire before its reply is awaited.

    Plain EVAL of the short script (no EVALSHA): Redis hashes and caches it, and there is no NOSCRIPT round trip
    after a Redis restart that would leave the record unwritten when the client's ``[DONE]`` goes out."""

    def __init__(self, redis: Any, keys: Keys, ttl_seconds: int, silence: SilenceConfig | None = None) -> None:
        self.keys = keys
        self.ttl_seconds = ttl_seconds
        self.ttl = str(ttl_seconds)
        self.silence = silence or SilenceConfig()
        self._pipe = PipelinedConnection(redis)

    def command(self, record: RolloutRecord) -> tuple:
        """The one EVAL that records ``record`` (and, for a tenant with silence tracking on, marks it due)."""
        keys = [self.keys.rollouts(record.tenant, record.prompt), self.keys.stats(record.policy_version, record.arm)]
        argv: list[Any] = [record.rollout_id, record.to_json(), self.ttl]
        if self.silence.tracked(record.tenant):
            keys.append(self.keys.silence_due(record.tenant))
            finished = record.finished_at or time.time()
            member = f"{prompt_digest(record.prompt)} {record.rollout_id}"
            argv += [member, repr(finished), repr(finished - self.ttl_seconds)]
        return ("EVAL", _STORE_ROLLOUT, len(keys), *keys, *argv)

    async def send(self, record: RolloutRecord) -> asyncio.Future:
        """Send the write now (readable by others once Redis reads it); the future is Redis's acknowledgement."""
        (acknowledged,) = await self._pipe.send([self.command(record)])
        return acknowledged

    async def store(self, record: RolloutRecord) -> None:
        await (await self.send(record))

    async def close(self) -> None:
        await self._pipe.close()
