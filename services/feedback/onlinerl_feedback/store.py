"""Redis side of the feedback service: read a tenant's rollouts, append one decision atomically.

The append is one Lua script (docs/architecture.md, "Delivery guarantees"): dedupe marker, XADD and stats counters
happen together or not at all, and with ``appendfsync always`` the script's effects are on disk before Redis replies
(a crash mid-write leaves an incomplete MULTI block at the AOF tail, which Redis discards on load). So an event can
never be marked seen without its entry, and an acknowledged entry is never lost.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from redis.exceptions import NoScriptError

from onlinerl.keys import Keys
from onlinerl.schemas import RolloutRecord

from .decide import Decision
from .pipeliner import Pipeliner

AUDIT_MAXLEN = 100_000

# KEYS: seen, stream, [stats]. ARGV: dedupe ttl, entry json, maxlen (0 = never trim), outcome, stats fields...
APPEND_LUA = """
local prev = redis.call('GET', KEYS[1])
if prev then return {0, prev} end
local id
if ARGV[3] ~= '0' then
  id = redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], '*', 'data', ARGV[2])
else
  id = redis.call('XADD', KEYS[2], '*', 'data', ARGV[2])
end
redis.call('SET', KEYS[1], ARGV[4] .. ' ' .. id, 'EX', ARGV[1])
if #KEYS >= 3 then
  for i = 5, #ARGV do redis.call('HINCRBY', KEYS[3], ARGV[i], 1) end
end
return {1, id}
"""
APPEND_SHA = hashlib.sha1(APPEND_LUA.encode()).hexdigest()


@dataclass(frozen=True)
class AppendResult:
    """``new`` is False for a duplicate; then ``outcome``/``entry_id`` are those of the first delivery."""

    new: bool
    outcome: str
    entry_id: str


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class FeedbackStore:
    """Reads and appends go through separate pipeliners (own connections): with ``appendfsync always`` a write
    batch waits for an fsync (milliseconds), and the next requests' rollout lookups must not queue behind it."""

    def __init__(self, reads: Pipeliner, writes: Pipeliner, keys: Keys, dedupe_ttl_seconds: int) -> None:
        self._reads = reads
        self._p = writes
        self._keys = keys
        self._ttl = str(dedupe_ttl_seconds)

    async def rollouts(self, tenant: str, prompt: str) -> list[RolloutRecord]:
        """Every rollout recorded for this tenant and prompt; a malformed record is skipped (it cannot be joined)."""
        raw = await self._reads.call("HGETALL", self._keys.rollouts(tenant, prompt))
        values = raw.values() if isinstance(raw, dict) else (raw or [])[1::2]  # RESP3 map or RESP2 flat list
        records = []
        for value in values:
            try:
                records.append(RolloutRecord.model_validate_json(value))
            except ValueError:
                continue
        return records

    async def append(self, tenant: str, event_id: str, decision: Decision) -> AppendResult:
        keys = [self._keys.seen(tenant, event_id), self._keys.samples if decision.to_samples else self._keys.audit]
        if decision.stats and decision.version is not None:
            keys.append(self._keys.stats(decision.version, decision.arm))
        maxlen = "0" if decision.to_samples else str(AUDIT_MAXLEN)  # samples are never trimmed here
        argv = [self._ttl, decision.entry, maxlen, decision.status, *decision.stats]
        try:
            reply = await self._p.call("EVALSHA", APPEND_SHA, len(keys), *keys, *argv)
        except NoScriptError:
            # Script cache is empty after a Redis restart; the script did not run, so running it now is safe.
            reply = await self._p.call("EVAL", APPEND_LUA, len(keys), *keys, *argv)
        created, value = int(reply[0]), _text(reply[1])
        if created:
            return AppendResult(True, decision.status, value)
        outcome, _, entry_id = value.partition(" ")
        return AppendResult(False, outcome, entry_id)
