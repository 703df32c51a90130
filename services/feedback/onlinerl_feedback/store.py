"""Redis side of the feedback service: read a tenant's rollouts, append one decision atomically.

The append is one Lua script (docs/architecture.md, "Delivery guarantees"): dedupe check, rated check, XADD, the
``seen`` and ``rated`` marks and the stats counters happen together or not at all, and with ``appendfsync always`` the
script's effects are on disk before Redis replies (a crash mid-write leaves an incomplete MULTI block at the AOF tail,
which Redis discards on load). So an event can never be marked seen without its entry, a rollout can never be rated
twice (the check and the mark are one atomic step), and an acknowledged entry is never lost.

A duplicate (seen ``completionId``, or a rollout rated between our read and the script) is audited with a second,
plain write: it costs a round trip only for the duplicate itself, never on the first delivery.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

from redis.exceptions import NoScriptError

from onlinerl.keys import RATED_FIELD_PREFIX, Keys
from onlinerl.schemas import CompletionOutcome, RolloutRecord

from .decide import COMPLETION_ID_SEEN, DUPLICATE, ROLLOUT_ALREADY_RATED, Decision, audit_entry, duplicate
from .pipeliner import Pipeliner

AUDIT_MAXLEN = 100_000

# KEYS: seen, stream, [rollouts hash (when the event rates a rollout), [stats]].
# ARGV: dedupe ttl, entry json, maxlen (0 = never trim), outcome, rated field ('' = none), rollout ttl,
#       then (stats field, amount) pairs.
# Replies: {1, entry id} appended; {0, "<outcome> <id>"} completionId seen; {2, "<outcome> <id>"} rollout rated.
APPEND_LUA = """
local prev = redis.call('GET', KEYS[1])
if prev then return {0, prev} end
local rated = ARGV[5] ~= ''
if rated then
  local first = redis.call('HGET', KEYS[3], ARGV[5])
  if first then return {2, first} end
end
local id
if ARGV[3] ~= '0' then
  id = redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], '*', 'data', ARGV[2])
else
  id = redis.call('XADD', KEYS[2], '*', 'data', ARGV[2])
end
local mark = ARGV[4] .. ' ' .. id
redis.call('SET', KEYS[1], mark, 'EX', ARGV[1])
if rated then
  redis.call('HSET', KEYS[3], ARGV[5], mark)
  if redis.call('TTL', KEYS[3]) < 0 then redis.call('EXPIRE', KEYS[3], ARGV[6]) end
end
if #KEYS >= 4 then
  for i = 7, #ARGV - 1, 2 do redis.call('HINCRBY', KEYS[4], ARGV[i], ARGV[i + 1]) end
end
return {1, id}
"""
APPEND_SHA = hashlib.sha1(APPEND_LUA.encode()).hexdigest()


@dataclass(frozen=True)
class Rollouts:
    """A prompt's rollout records, and which of them were already rated (rollout_id -> "<outcome> <entry id>")."""

    records: list[RolloutRecord]
    rated: dict[str, str]


@dataclass(frozen=True)
class AppendResult:
    """``new`` is False for a duplicate; then ``outcome``/``entry_id`` are those of the delivery that counted,
    ``reason`` says why (completion_id_seen, rollout_already_rated) and ``audit_id`` is this event's audit entry."""

    new: bool
    outcome: str
    entry_id: str
    reason: str = ""
    audit_id: str = ""

    def duplicate_fields(self) -> dict[str, str]:
        """The fields of a ``duplicate`` reply."""
        return {
            "reason": self.reason,
            "first_outcome": self.outcome,
            "entry_id": self.entry_id,
            "audit_id": self.audit_id,
        }


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class FeedbackStore:
    """Reads and appends go through separate pipeliners (own connections): with ``appendfsync always`` a write
    batch waits for an fsync (milliseconds), and the next requests' rollout lookups must not queue behind it."""

    def __init__(
        self, reads: Pipeliner, writes: Pipeliner, keys: Keys, dedupe_ttl_seconds: int, rollout_ttl_seconds: int
    ) -> None:
        self._reads = reads
        self._p = writes
        self._keys = keys
        self._ttl = str(dedupe_ttl_seconds)
        self._rollout_ttl = str(rollout_ttl_seconds)

    async def rollouts(self, tenant: str, prompt: str) -> Rollouts:
        """Every rollout recorded for this tenant and prompt, and the rated marks of the same hash (one HGETALL);
        a malformed record is skipped (it cannot be joined)."""
        raw = await self._reads.call("HGETALL", self._keys.rollouts(tenant, prompt))
        if isinstance(raw, dict):  # RESP3 map or RESP2 flat list
            items = raw.items()
        else:
            raw = raw or []
            items = zip(raw[0::2], raw[1::2], strict=True)
        records, rated = [], {}
        prefix = RATED_FIELD_PREFIX.encode()
        for name, value in items:
            if isinstance(name, bytes) and name.startswith(prefix):
                rated[name[len(prefix) :].decode()] = _text(value)
                continue
            try:
                records.append(RolloutRecord.model_validate_json(value))
            except ValueError:
                continue
        return Rollouts(records, rated)

    async def _run(self, keys: list[str], argv: list) -> tuple[int, str]:
        try:
            reply = await self._p.call("EVALSHA", APPEND_SHA, len(keys), *keys, *argv)
        except NoScriptError:
            # Script cache is empty after a Redis restart; the script did not run, so running it now is safe.
            reply = await self._p.call("EVAL", APPEND_LUA, len(keys), *keys, *argv)
        return int(reply[0]), _text(reply[1])

    async def append(self, event: CompletionOutcome, tenant: str, prompt: str, decision: Decision) -> AppendResult:
        """Append ``decision`` atomically; a duplicate is audited instead (see the module doc)."""
        keys = [
            self._keys.seen(tenant, event.completion_id),
            self._keys.samples if decision.to_samples else self._keys.audit,
        ]
        argv: list = [self._ttl, decision.entry, "0" if decision.to_samples else str(AUDIT_MAXLEN), decision.status]
        if decision.rates:
            keys.append(self._keys.rollouts(tenant, prompt))
            argv += [self._keys.rated_field(decision.rates), self._rollout_ttl]
            if decision.counters and decision.version is not None:
                keys.append(self._keys.stats(decision.version, decision.arm))
                argv += [x for pair in decision.counters for x in pair]
        else:
            argv += ["", self._rollout_ttl]  # samples are never trimmed here; only a rated event bumps counters
        status, value = await self._run(keys, argv)
        if status == 1:
            if decision.first:  # decided as a duplicate at read time: its audit entry is what was appended
                outcome, _, entry_id = decision.first.partition(" ")
                return AppendResult(False, outcome, entry_id, decision.reason, value)
            return AppendResult(True, decision.status, value)
        if status == 2:  # the rollout was rated between our read and the script: audit this one as a duplicate
            rid = decision.rates
            dup = duplicate(event, tenant, prompt, ROLLOUT_ALREADY_RATED, value, rid)
            return await self.append(event, tenant, prompt, dup)
        # completionId recorded before: the verdict stands; this delivery is audited only (a plain capped XADD).
        outcome, _, entry_id = value.partition(" ")
        entry = audit_entry(event, tenant, prompt, DUPLICATE, COMPLETION_ID_SEEN, time.time(), decision.rates, value)
        audit_id = _text(await self._p.call("XADD", self._keys.audit, "MAXLEN", "~", AUDIT_MAXLEN, "*", "data", entry))
        return AppendResult(False, outcome, entry_id, COMPLETION_ID_SEEN, audit_id)
