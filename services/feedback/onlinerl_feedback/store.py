"""Redis side of the feedback service: read a tenant's rollouts, append one decision atomically.

The append is one Lua script (docs/architecture.md, "Delivery guarantees"): dedupe check, rated check, XADD, the
``seen`` and ``rated`` marks and the stats counters happen together or not at all, and with ``appendfsync always`` the
script's effects are on disk before Redis replies (a crash mid-write leaves an incomplete MULTI block at the AOF tail,
which Redis discards on load). So an event can never be marked seen without its entry, a rollout can never be rated
twice (the check and the mark are one atomic step), and an acknowledged entry is never lost.

A duplicate (seen ``completionId``, or a rollout rated between our read and the script) is audited with a second,
plain write: it costs a round trip only for the duplicate itself, never on the first delivery.

The same script applies the per-user contribution limit and quarantine (limits.py): an event whose user may not
contribute goes to ``audit`` instead, in the same atomic step, so no burst of concurrent events can slip past a limit.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

from redis.exceptions import NoScriptError

from onlinerl.config import FeedbackLimitsConfig
from onlinerl.keys import RATED_FIELD_PREFIX, Keys
from onlinerl.schemas import CompletionOutcome, RolloutRecord

from .decide import (
    COMPLETION_ID_SEEN,
    CONTRIBUTION_LIMIT,
    DUPLICATE,
    QUARANTINED,
    REJECTED,
    ROLLOUT_ALREADY_RATED,
    Decision,
    audit_entry,
    duplicate,
)
from .limits import ANONYMOUS_USER, limit_args
from .pipeliner import Pipeliner

AUDIT_MAXLEN = 100_000
LIMITED, QUARANTINED_REPLY = 3, 4  # script replies: audited because over the limit / quarantined

# KEYS: seen, stream, audit, rollouts hash, stats, contrib counter, quarantine mark, user stats, tenant stats (an unused
#       rollouts/stats key is a placeholder under the job's prefix; the script does not touch it).
# ARGV: 1 dedupe ttl, 2 entry json, 3 maxlen (0 = never trim), 4 outcome, 5 rated field ('' = none), 6 rollout ttl,
#       7 audit maxlen, 8-17 the limit step (limits.py: subject, limit, limited entry, quarantined entry, k, min shown,
#       stats window, shown, accepted, limited outcome), then (stats field, amount) pairs.
# Replies: {1, entry id, newly quarantined 0|1} appended as decided; {3, audit id} over the contribution limit;
#          {4, audit id} user quarantined; {0, "<outcome> <id>"} completionId seen; {2, "<outcome> <id>"} rollout rated.
APPEND_LUA = """
local prev = redis.call('GET', KEYS[1])
if prev then return {0, prev} end
local rated = ARGV[5] ~= ''
if rated then
  local first = redis.call('HGET', KEYS[4], ARGV[5])
  if first then return {2, first} end
end
local status, stream, entry, maxlen, outcome = 1, KEYS[2], ARGV[2], ARGV[3], ARGV[4]
if ARGV[8] == '1' then
  if redis.call('EXISTS', KEYS[7]) == 1 then
    status, entry = 4, ARGV[11]
  elseif tonumber(ARGV[9]) > 0 then
    local n = redis.call('INCR', KEYS[6])
    if n == 1 then redis.call('EXPIRE', KEYS[6], 7200) end
    if n > tonumber(ARGV[9]) then status, entry = 3, ARGV[10] end
  end
  if status ~= 1 then stream, maxlen, outcome = KEYS[3], ARGV[7], ARGV[17] end
end
local id
if maxlen ~= '0' then
  id = redis.call('XADD', stream, 'MAXLEN', '~', maxlen, '*', 'data', entry)
else
  id = redis.call('XADD', stream, '*', 'data', entry)
end
local mark = outcome .. ' ' .. id
redis.call('SET', KEYS[1], mark, 'EX', ARGV[1])
if rated then
  redis.call('HSET', KEYS[4], ARGV[5], mark)
  if redis.call('TTL', KEYS[4]) < 0 then redis.call('EXPIRE', KEYS[4], ARGV[6]) end
end
if status ~= 1 then return {status, id} end
for i = 18, #ARGV - 1, 2 do redis.call('HINCRBY', KEYS[5], ARGV[i], ARGV[i + 1]) end
local fresh = 0
if ARGV[8] == '1' and ARGV[15] ~= '0' then
  local nu = redis.call('HINCRBY', KEYS[8], 'shown', ARGV[15])
  local au = redis.call('HINCRBY', KEYS[8], 'accepted', ARGV[16])
  local nt = redis.call('HINCRBY', KEYS[9], 'shown', ARGV[15])
  local at = redis.call('HINCRBY', KEYS[9], 'accepted', ARGV[16])
  redis.call('EXPIRE', KEYS[8], ARGV[14])
  redis.call('EXPIRE', KEYS[9], ARGV[14])
  local k, least = tonumber(ARGV[12]), tonumber(ARGV[13])
  local nr = nt - nu
  if k > 0 and nu >= least and nr >= least then
    local p = (at - au) / nr
    local sigma = math.max(math.sqrt(p * (1 - p) / nu), 1 / nu)
    if au / nu > p + k * sigma then
      local why = 'accept rate ' .. au .. '/' .. nu .. ' vs tenant rest ' .. (at - au) .. '/' .. nr
      if redis.call('SET', KEYS[7], why, 'NX') then fresh = 1 end
    end
  end
end
return {1, id, fresh}
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
    ``reason`` says why (completion_id_seen, rollout_already_rated) and ``audit_id`` is this event's audit entry.
    ``limited``: the user may not contribute (``reason``), the event was audited under ``entry_id``."""

    new: bool
    outcome: str
    entry_id: str
    reason: str = ""
    audit_id: str = ""
    limited: bool = False  # audited instead of appended: ``reason`` is contribution_limit or quarantined
    quarantined_now: bool = False  # this event's anomaly test quarantined its user (the event itself counted)

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
        self,
        reads: Pipeliner,
        writes: Pipeliner,
        keys: Keys,
        dedupe_ttl_seconds: int,
        rollout_ttl_seconds: int,
        limits: FeedbackLimitsConfig | None = None,
    ) -> None:
        self._reads = reads
        self._p = writes
        self._keys = keys
        self._ttl = str(dedupe_ttl_seconds)
        self._rollout_ttl = str(rollout_ttl_seconds)
        self._limits = limits or FeedbackLimitsConfig()

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

    async def _run(self, keys: list[str], argv: list) -> tuple[int, str, bool]:
        try:
            reply = await self._p.call("EVALSHA", APPEND_SHA, len(keys), *keys, *argv)
        except NoScriptError:
            # Script cache is empty after a Redis restart; the script did not run, so running it now is safe.
            reply = await self._p.call("EVAL", APPEND_LUA, len(keys), *keys, *argv)
        return int(reply[0]), _text(reply[1]), len(reply) > 2 and int(reply[2]) == 1

    async def append(
        self, event: CompletionOutcome, tenant: str, prompt: str, decision: Decision, user: str = ANONYMOUS_USER
    ) -> AppendResult:
        """Append ``decision`` atomically, or audit it if ``user`` is quarantined or over its contribution limit
        (limits.py); a duplicate is audited instead (see the module doc)."""
        unused = self._keys.prefix + "-"
        counted = bool(decision.rates and decision.counters and decision.version is not None)
        limit = limit_args(self._keys, self._limits, event, tenant, user, prompt, decision)
        keys = [
            self._keys.seen(tenant, event.completion_id),
            self._keys.samples if decision.to_samples else self._keys.audit,
            self._keys.audit,
            self._keys.rollouts(tenant, prompt) if decision.rates else unused,
            self._keys.stats(decision.version, decision.arm) if counted else unused,
            *limit.keys,
        ]
        argv: list = [
            self._ttl,
            decision.entry,
            "0" if decision.to_samples else str(AUDIT_MAXLEN),
            decision.status,
            self._keys.rated_field(decision.rates) if decision.rates else "",
            self._rollout_ttl,
            str(AUDIT_MAXLEN),
            *limit.argv,
        ]
        if counted:
            argv += [x for pair in decision.counters for x in pair]  # only a rated event bumps counters
        status, value, fresh = await self._run(keys, argv)
        if status in (LIMITED, QUARANTINED_REPLY):
            reason = CONTRIBUTION_LIMIT if status == LIMITED else QUARANTINED
            return AppendResult(True, REJECTED, value, reason=reason, limited=True)
        if status == 1:
            if decision.first:  # decided as a duplicate at read time: its audit entry is what was appended
                outcome, _, entry_id = decision.first.partition(" ")
                return AppendResult(False, outcome, entry_id, decision.reason, value)
            return AppendResult(True, decision.status, value, quarantined_now=fresh)
        if status == 2:  # the rollout was rated between our read and the script: audit this one as a duplicate
            rid = decision.rates
            dup = duplicate(event, tenant, prompt, ROLLOUT_ALREADY_RATED, value, rid)
            return await self.append(event, tenant, prompt, dup)
        # completionId recorded before: the verdict stands; this delivery is audited only (a plain capped XADD).
        outcome, _, entry_id = value.partition(" ")
        entry = audit_entry(event, tenant, prompt, DUPLICATE, COMPLETION_ID_SEEN, time.time(), decision.rates, value)
        audit_id = _text(await self._p.call("XADD", self._keys.audit, "MAXLEN", "~", AUDIT_MAXLEN, "*", "data", entry))
        return AppendResult(False, outcome, entry_id, COMPLETION_ID_SEEN, audit_id)
