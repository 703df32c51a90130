"""Rollout capture: accumulate what vLLM generated, strip what the client did not ask for, store the record.

The record's write must reach Redis before the client sees the end of the response (``data: [DONE]`` or the JSON
body), so a feedback upload, which can only follow that, always finds it. Its acknowledgement (which waits for the
AOF fsync) is awaited after the response is out. A tenant over ``serving.maxRecordsPerTenant`` loses its oldest
records, never the request: the script evicts them and its reply is counted and logged here.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import Counter

from onlinerl.config import ServingConfig, SilenceConfig
from onlinerl.dataplane import rollouts
from onlinerl.keys import Keys
from onlinerl.redis_pipe import PipelinedConnection
from onlinerl.schemas import RolloutRecord, SamplingParams

log = logging.getLogger("onlinerl.gateway.capture")

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
        canary: int | None = None,
        line: str = "",
    ) -> RolloutRecord:
        return RolloutRecord(
            rollout_id=rollout_id or uuid.uuid4().hex,
            tenant=tenant,
            arm=arm,
            policy_version=version,
            line=line,
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
            canary=canary,
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


class EvictionLog:
    """Logs a tenant's evictions at most once per ``every`` seconds (with the count since the last line), so a tenant
    that sits at its cap leaves one line a minute, not one per request."""

    def __init__(self, every: float = 60.0) -> None:
        self.every = every
        self._pending: dict[str, int] = {}
        self._last: dict[str, float] = {}

    def add(self, tenant: str, evicted: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._pending[tenant] = self._pending.get(tenant, 0) + evicted
        last = self._last.get(tenant)
        if last is None or now - last >= self.every:
            log.warning(
                "tenant %s is over serving.maxRecordsPerTenant: evicted its %d oldest rollout record(s)",
                tenant,
                self._pending.pop(tenant),
            )
            self._last[tenant] = now


class RolloutStore:
    """Writes rollout records on a pipelined connection, so a write can be on the wire before its reply is awaited.

    One EVAL per record (onlinerl/dataplane/rollouts.py: record, per-record TTL, the tenant's cap, silence due-set).
    Plain EVAL of the short script (no EVALSHA): Redis hashes and caches it, and there is no NOSCRIPT round trip
    after a Redis restart that would leave the record unwritten when the client's ``[DONE]`` goes out."""

    def __init__(
        self,
        redis: Any,
        keys: Keys,
        ttl_seconds: int,
        silence: SilenceConfig | None = None,
        max_records_per_tenant: int | None = None,
        evicted: Counter | None = None,
    ) -> None:
        self.keys = keys
        self.ttl_seconds = ttl_seconds
        self.max_records = max_records_per_tenant or ServingConfig().max_records_per_tenant
        self.silence = silence or SilenceConfig()
        self.evicted = evicted  # onlinerl_serving_rollout_records_evicted_total{tenant}
        self.eviction_log = EvictionLog()
        self._pipe = PipelinedConnection(redis)

    def command(self, record: RolloutRecord, prompt: str | None = None) -> tuple:
        """The one EVAL that records ``record`` (and, for a tenant with silence tracking on, marks it due).
        ``prompt``: the served prompt, whose digest names the record's hash (a redacted record holds no prompt)."""
        tracked = self.silence.tracked(record.tenant)
        # ``served`` and the canary's per-user ledger count on the line that served it (issue 39: a project's own line
        # has its own versions and canary); the records, index and due-set are the tenant's whatever the line.
        keys = self.keys.for_line(record.line)
        return rollouts.record_command(keys, record, self.ttl_seconds, self.max_records, tracked, prompt)

    async def send(self, record: RolloutRecord, prompt: str | None = None) -> asyncio.Future:
        """Send the write now (readable by others once Redis reads it); the future is Redis's acknowledgement."""
        (acknowledged,) = await self._pipe.send([self.command(record, prompt)])
        return acknowledged

    def acknowledged(self, tenant: str, reply: Any) -> rollouts.RecordWritten:
        """Account for what the write did once Redis acknowledged it: evictions are counted and logged."""
        written = rollouts.RecordWritten.of(reply)
        if written.evicted:
            if self.evicted is not None:
                self.evicted.labels(tenant).inc(written.evicted)
            self.eviction_log.add(tenant, written.evicted)
        return written

    async def store(self, record: RolloutRecord) -> rollouts.RecordWritten:
        return self.acknowledged(record.tenant, await (await self.send(record)))

    async def close(self) -> None:
        await self._pipe.close()
