"""Rollout records: the gateway writes one per completion, feedback joins outcomes to them and settles silences.

Keys (``onlinerl.keys.Keys``, all under the job's hash tag):

- ``rollouts:{tenant}:{digest}`` hash, one per tenant and prompt: field ``{rollout_id}`` = RolloutRecord JSON, field
  ``rated:{rollout_id}`` = ``"<outcome> <entry id>"`` of the one event (or silence) that rated it. Each field has its
  own TTL (hash-field expiration, valkey >= 9.0 / Redis >= 7.4): a record expires ``ttl`` after it was written even
  when the same prompt keeps being served, and a rated mark outlives the record it guards.
- ``rollouts-index:{tenant}`` sorted set ``"<digest> <rollout_id>"`` scored by finish time: every live record of the
  tenant, so the record script can cap a tenant at ``serving.maxRecordsPerTenant`` by evicting its oldest.
- ``silence:{tenant}`` sorted set, same members: rollouts of a tenant with silence tracking on, until the feedback
  sweeper settles each.

Writers: serving (``record_command``), feedback (the append script in the feedback store sets ``rated:``; the
silence settle script here). Readers: feedback (``rollouts_command`` + ``parse_rollouts``, ``due_members``,
``read_due``). No other code sends a command on these keys.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis

from onlinerl.arms import CANDIDATE, STABLE
from onlinerl.keys import RATED_FIELD_PREFIX, Keys, prompt_digest
from onlinerl.schemas import RolloutRecord

from .codec import pairs, text
from .scripts import Script

# The gateway's record write, one atomic round trip (it is on the completion's hot path):
# HSET the record with its own field TTL (the hash's TTL is only a backstop: it is refreshed whenever the prompt is
# served again, so alone it would keep a repeated prompt's old records for ever); index it for the tenant, drop index
# entries older than the TTL (their records are gone) and, over the cap, evict the tenant's oldest records (HDEL of the
# record only: its ``rated:`` mark stays until its own TTL, so a rollout can never be rated twice); for a tenant with
# silence tracking on, mark it due; count it as served. Evicted records' hashes are named from their index member
# (same hash tag, same slot: fine on Redis Cluster).
# During a canary it also counts the rollout under its user in the canary's per-user ledger (``Keys.arm_users``),
# which the rollout controller reads to cap each user's share and to check that no verdict rests on one user.
# KEYS: rollouts hash, stats, tenant index, per-user ledger (the stats key as a placeholder when none), [silence
# due-set].
# ARGV: rollout_id, record json, ttl, member, finished_at, cut-off (finished_at - ttl), cap, rollouts key prefix,
# ledger field ('' = no ledger: "<user>:served"), ledger ttl.
# Reply: {served count, records evicted}.
RECORD = Script(
    """
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('HEXPIRE', KEYS[1], ARGV[3], 'FIELDS', 1, ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[3])
redis.call('ZADD', KEYS[3], ARGV[5], ARGV[4])
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', '(' .. ARGV[6])
redis.call('EXPIRE', KEYS[3], ARGV[3])
local evicted = 0
local over = redis.call('ZCARD', KEYS[3]) - tonumber(ARGV[7])
if over > 0 then
  local oldest = redis.call('ZPOPMIN', KEYS[3], over)
  for i = 1, #oldest, 2 do
    local digest, rid = string.match(oldest[i], '^(%S+) (%S+)$')
    if digest then evicted = evicted + redis.call('HDEL', ARGV[8] .. digest, rid) end
  end
end
if #KEYS >= 5 then
  redis.call('ZADD', KEYS[5], ARGV[5], ARGV[4])
  redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', '(' .. ARGV[6])
  redis.call('EXPIRE', KEYS[5], ARGV[3])
end
if ARGV[9] ~= '' then
  redis.call('HINCRBY', KEYS[4], ARGV[9], 1)
  redis.call('EXPIRE', KEYS[4], ARGV[10])
end
return {redis.call('HINCRBY', KEYS[2], 'served', 1), evicted}
"""
)

# The silence sweeper's settle step for one due rollout: remove the due entry (if another sweeper removed it first,
# stop), check the rollout's ``rated:`` mark (a real outcome came first: skip), check the record still exists (expired
# or evicted: skip), then XADD, set the mark (with the record's remaining TTL: it lives as long as what it guards) and
# bump the arm's counters. The mark is the same field the feedback append script checks and sets atomically.
# KEYS: due-set, rollouts hash, stream (samples or audit), [stats]. ARGV: due member, rated field, entry json
# ('' = nothing to append: the pre-read found the rollout rated or gone), rollout_id, maxlen (0 = never trim),
# outcome, then (stats field, amount) pairs.
# Replies: {0, ''} another sweeper took it; {1, entry id} appended; {2, mark} rated first; {3, ''} record gone.
SETTLE_SILENCE = Script(
    """
if redis.call('ZREM', KEYS[1], ARGV[1]) == 0 then return {0, ''} end
local first = redis.call('HGET', KEYS[2], ARGV[2])
if first then return {2, first} end
if ARGV[3] == '' or redis.call('HEXISTS', KEYS[2], ARGV[4]) == 0 then return {3, ''} end
local id
if ARGV[5] ~= '0' then
  id = redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[5], '*', 'data', ARGV[3])
else
  id = redis.call('XADD', KEYS[3], '*', 'data', ARGV[3])
end
redis.call('HSET', KEYS[2], ARGV[2], ARGV[6] .. ' ' .. id)
local left = redis.call('HPTTL', KEYS[2], 'FIELDS', 1, ARGV[4])[1]
if left > 0 then redis.call('HPEXPIRE', KEYS[2], left, 'FIELDS', 1, ARGV[2]) end
if #KEYS >= 4 then
  for i = 7, #ARGV - 1, 2 do redis.call('HINCRBY', KEYS[4], ARGV[i], ARGV[i + 1]) end
end
return {1, id}
"""
)
TAKEN_BY_OTHER, SETTLED, RATED_FIRST, GONE = 0, 1, 2, 3  # SETTLE_SILENCE's reply statuses


# --- members ---------------------------------------------------------------------------------------------------
def member(prompt: str, rollout_id: str) -> str:
    """``"<prompt digest> <rollout_id>"``: an index or due entry names its record's hash and field."""
    return f"{prompt_digest(prompt)} {rollout_id}"


def parse_member(value: str) -> tuple[str, str] | None:
    """``(digest, rollout_id)`` of an index or due entry, or None if it is not one the gateway wrote."""
    digest, sep, rid = value.partition(" ")
    if not sep or not digest or not rid or " " in rid:
        return None
    return digest, rid


# --- the gateway's write ---------------------------------------------------------------------------------------
LEDGER_TTL_SECONDS = 30 * 24 * 3600  # a per-user ledger outlives any canary; refreshed on every write


def user_ledger(keys: Keys, record: RolloutRecord) -> tuple[str, str] | None:
    """``(ledger key, user)`` a rollout counts under in its canary's per-user ledger, or None (no canary running
    when it was routed, or an arm the canary does not compare). The user is the served key's ``user_hash`` (the
    gateway's, never a client-sent id); the gateway counts ``served`` there, feedback the rest (the append script)."""
    return ledger_for(keys, record.policy_version, record.arm, record.canary, record.user_hash)


def ledger_for(keys: Keys, version: int, arm: str, canary: int | None, user: str) -> tuple[str, str] | None:
    """``user_ledger`` from the record's parts (feedback carries them in its decision)."""
    if canary is None or arm not in (STABLE, CANDIDATE):
        return None
    return keys.arm_users(version, arm, canary), user or "anonymous"


@dataclass(frozen=True)
class RecordWritten:
    """What the record script did: the arm's ``served`` count after it, and how many old records it evicted."""

    served: int
    evicted: int

    @classmethod
    def of(cls, reply: Any) -> RecordWritten:
        return cls(int(reply[0]), int(reply[1]))


def record_command(
    keys: Keys,
    record: RolloutRecord,
    ttl_seconds: int,
    max_records: int,
    silence_due: bool,
    prompt: str | None = None,
) -> tuple[Any, ...]:
    """The one EVAL (full source: it is pipelined, so a NOSCRIPT retry could reorder replies) that stores
    ``record`` for ``ttl_seconds``, keeps its tenant at ``max_records`` at most and, if ``silence_due``, marks it
    due. ``prompt``: the served prompt, whose digest names the hash (default the record's own; a record redacted for
    a credential holds none, and is still filed under its prompt's digest so that its feedback finds it)."""
    tenant = record.tenant
    prompt = record.prompt if prompt is None else prompt
    finished = record.finished_at or record.created_at
    ledger = user_ledger(keys, record)
    ks = [
        keys.rollouts(tenant, prompt),
        keys.stats(record.policy_version, record.arm),
        keys.rollouts_index(tenant),
        ledger[0] if ledger else keys.stats(record.policy_version, record.arm),
    ]
    if silence_due:
        ks.append(keys.silence_due(tenant))
    argv = [
        record.rollout_id,
        record.to_json(),
        str(ttl_seconds),
        member(prompt, record.rollout_id),
        repr(finished),
        repr(finished - ttl_seconds),
        str(max_records),
        keys.rollouts_by_digest(tenant, ""),
        f"{ledger[1]}:served" if ledger else "",
        str(LEDGER_TTL_SECONDS),
    ]
    return RECORD.eval_command(ks, argv)


# --- feedback's join read --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Rollouts:
    """A prompt's rollout records, and which of them were already rated (rollout_id -> "<outcome> <entry id>")."""

    records: list[RolloutRecord]
    rated: dict[str, str]


def rollouts_command(keys: Keys, tenant: str, prompt: str) -> tuple[str, str]:
    """One HGETALL: every live record of this tenant and prompt and the rated marks of the same hash."""
    return ("HGETALL", keys.rollouts(tenant, prompt))


def parse_rollouts(raw: Any) -> Rollouts:
    """The reply of ``rollouts_command`` (a RESP3 map or a RESP2 flat list); a malformed record is skipped (it
    cannot be joined)."""
    records, rated = [], {}
    prefix = RATED_FIELD_PREFIX
    for name, value in pairs(raw):
        name = text(name)
        if name.startswith(prefix):
            rated[name[len(prefix) :]] = text(value)
            continue
        try:
            records.append(RolloutRecord.model_validate_json(value))
        except ValueError:
            continue
    return Rollouts(records, rated)


# --- the silence sweeper -----------------------------------------------------------------------------------------
async def due_members(client: Any, keys: Keys, tenant: str, upto: float, batch: int) -> list[str]:
    """Up to ``batch`` due entries of ``tenant`` that finished at or before ``upto`` (oldest first)."""
    raw = await client.zrangebyscore(keys.silence_due(tenant), "-inf", upto, start=0, num=batch)
    return [text(m) for m in raw]


@dataclass(frozen=True)
class DueRead:
    """A due rollout's record JSON (None: expired or evicted) and its rated mark (None: not rated)."""

    raw: bytes | None
    rated: bytes | None


async def read_due(client: Any, keys: Keys, tenant: str, entries: Sequence[tuple[str, str] | None]) -> list[DueRead]:
    """One pipelined read of each entry's record and rated mark (None entries read as gone, keeping alignment)."""
    reads = client.pipeline(transaction=False)
    for entry in entries:
        if entry is None:
            reads.echo("")  # keeps replies aligned with entries
            continue
        digest, rid = entry
        reads.hmget(keys.rollouts_by_digest(tenant, digest), [rid, keys.rated_field(rid)])
    out = []
    for entry, reply in zip(entries, await reads.execute(), strict=True):
        out.append(DueRead(None, None) if entry is None else DueRead(reply[0], reply[1]))
    return out


@dataclass(frozen=True)
class Settle:
    """One due entry's settle step. ``entry`` empty: remove the due entry, append nothing (gone, rated or invalid);
    otherwise append ``entry`` to ``stream`` (trimmed at ``maxlen`` unless 0) and bump ``counters`` on ``stats``."""

    member: str
    rollout_id: str = ""
    digest: str = "-"
    entry: bytes | str = ""
    stream: str = ""
    stats: str = ""
    maxlen: int = 0
    outcome: str = ""
    counters: tuple[tuple[str, int], ...] = ()


def settle_args(keys: Keys, tenant: str, s: Settle) -> tuple[list[str], list[Any]]:
    """KEYS and ARGV of SETTLE_SILENCE for one due entry."""
    rollouts = keys.rollouts_by_digest(tenant, s.digest)
    rated = keys.rated_field(s.rollout_id) if s.rollout_id else ""
    ks = [keys.silence_due(tenant), rollouts, s.stream or keys.samples]
    if s.entry and s.stats:
        ks.append(s.stats)
    argv: list[Any] = [s.member, rated, s.entry, s.rollout_id, str(s.maxlen), s.outcome]
    argv += [x for pair in s.counters for x in pair]
    return ks, argv


async def settle_silences(client: Any, keys: Keys, tenant: str, settles: Sequence[Settle]) -> list[int]:
    """Run every settle step in one pipelined write; each one's reply status (TAKEN_BY_OTHER, SETTLED, RATED_FIRST,
    GONE)."""
    writes = client.pipeline(transaction=False)
    for s in settles:
        writes.execute_command(*SETTLE_SILENCE.eval_command(*settle_args(keys, tenant, s)))
    return [int(reply[0]) for reply in await writes.execute()]


# --- `onlinerl forget` (admin) ---------------------------------------------------------------------------------
@dataclass
class ForgottenRecords:
    """What ``forget_records`` deleted: rollout records, their rated marks, index and due entries; and the user
    hashes of the records it saw (a tenant-wide forget removes those users' per-user counters too)."""

    records: int = 0
    rated_marks: int = 0
    index_entries: int = 0
    users: set[str] | None = None


def forget_records(client: redis.Redis, keys: Keys, tenant: str, user: str | None) -> ForgottenRecords:
    """Delete ``tenant``'s rollout records (only ``user``'s: records whose ``user_hash`` is it), with their rated
    marks and their entries in the tenant's index and silence due-set. Each record is deleted by its field (its
    rollout id, never reused), so a record written meanwhile by the gateway for another user is left alone; one
    written for ``user`` after the scan passed its hash is not deleted (revoke the key first: see `onlinerl forget`)."""
    out = ForgottenRecords(users=set())
    members: list[str] = []
    for key in client.scan_iter(match=keys.rollouts_by_digest(tenant, "*"), count=500):
        digest = text(key).rsplit(":", 1)[1]
        drop: list[str] = []
        for name, value in pairs(client.hgetall(key)):
            name = text(name)
            if name.startswith(RATED_FIELD_PREFIX):
                continue
            try:
                rec = RolloutRecord.model_validate_json(value)
            except ValueError:
                rec = None
            if rec is not None and rec.user_hash:
                out.users.add(rec.user_hash)  # type: ignore[union-attr]
            if user is None or (rec is not None and rec.user_hash == user):
                drop += [name, keys.rated_field(name)]
                members.append(f"{digest} {name}")
        if drop:
            pipe = client.pipeline(transaction=False)
            pipe.hdel(key, *drop[0::2])
            pipe.hdel(key, *drop[1::2])
            deleted, marks = pipe.execute()
            out.records += int(deleted)
            out.rated_marks += int(marks)
    if user is None:  # the whole tenant: its rated marks of records already gone, and both sorted sets
        for key in client.scan_iter(match=keys.rollouts_by_digest(tenant, "*"), count=500):
            out.rated_marks += int(client.hlen(key))
            client.unlink(key)
        out.index_entries = int(client.zcard(keys.rollouts_index(tenant))) + int(client.zcard(keys.silence_due(tenant)))
        client.unlink(keys.rollouts_index(tenant), keys.silence_due(tenant))
    elif members:
        for i in range(0, len(members), 500):
            part = members[i : i + 500]
            out.index_entries += int(client.zrem(keys.rollouts_index(tenant), *part))
            out.index_entries += int(client.zrem(keys.silence_due(tenant), *part))
    return out
