"""The silence sweeper: turns each served rollout that got no outcome in time into exactly one silence outcome.

The gateway's record script adds every rollout of a tenant with ``feedback.silence`` on to ``silence:{tenant}``
(scored by finish time; onlinerl/keys.py). Each tick this task takes the entries older than the window, reads their
records, decides what silence means for each (silence.py, pure) and settles each in one Lua script: remove the due
entry (if another sweeper, a second worker or replica, removed it first, stop), check the rollout's ``rated:`` mark
(a real outcome came first: skip), check the record still exists (it expired: skip), then XADD, set the mark and bump
``silent``. The rated check and mark are the same field the feedback append script checks and sets atomically
(store.py), so a rollout gets a real rating or a silence outcome, never both, and a client's late outcome is a
``duplicate`` of the silence. A crash before the script leaves the entry due; the next tick settles it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter
from redis.asyncio import Redis
from redis.exceptions import RedisError

from onlinerl.aio import cancel_and_wait
from onlinerl.config import FeedbackConfig
from onlinerl.keys import Keys
from onlinerl.schemas import RolloutRecord

from .silence import SILENT, decide_silence
from .store import AUDIT_MAXLEN

log = logging.getLogger("onlinerl_feedback.silence")

# KEYS: due-set, rollouts hash, stream (samples or audit), [stats]. ARGV: due member, rated field, entry json
# ('' = nothing to append: the pre-read found the rollout rated or gone), rollout_id, maxlen (0 = never trim),
# outcome, then (stats field, amount) pairs.
# Replies: {0, ''} another sweeper took it; {1, entry id} appended; {2, mark} rated first; {3, ''} record gone.
SILENCE_LUA = """
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
if #KEYS >= 4 then
  for i = 7, #ARGV - 1, 2 do redis.call('HINCRBY', KEYS[4], ARGV[i], ARGV[i + 1]) end
end
return {1, id}
"""

TRAINED, AUDITED, RATED, EXPIRED, INVALID, TAKEN = "trained", "audited", "rated", "expired", "invalid", "taken"
RESULTS = (TRAINED, AUDITED, RATED, EXPIRED, INVALID)  # metric labels; TAKEN is another sweeper's work


def silence_counter(registry: CollectorRegistry) -> Counter:
    """``onlinerl_feedback_silence_total{result}``: trained/audited = silence outcomes produced, rated/expired/
    invalid = due rollouts skipped."""
    counter = Counter(
        "onlinerl_feedback_silence_total",
        "Unreported rollouts settled by the silence sweeper, by result.",
        ["result"],
        registry=registry,
    )
    for result in RESULTS:
        counter.labels(result)
    return counter


@dataclass
class SweepCounts:
    """What one sweep did, per result (tests and logs read it; the metric sums it)."""

    counts: dict[str, int] = field(default_factory=dict)

    def add(self, result: str) -> None:
        self.counts[result] = self.counts.get(result, 0) + 1

    def __getitem__(self, result: str) -> int:
        return self.counts.get(result, 0)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class SilenceSweeper:
    """Settles due rollouts of every tenant with silence on, every ``sweepIntervalSeconds``."""

    def __init__(self, client: Redis, keys: Keys, cfg: FeedbackConfig, counter: Counter | None = None) -> None:
        self.client = client
        self.keys = keys
        self.cfg = cfg
        self.silence = cfg.silence
        self.counter = counter
        self._task: asyncio.Task | None = None

    @property
    def tenants(self) -> list[str]:
        return sorted(t for t, on in self.silence.tenants.items() if on)

    def start(self) -> None:
        if self._task is None and self.tenants:
            self._task = asyncio.create_task(self._run(), name="silence-sweeper")

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

    async def _run(self) -> None:
        while True:
            try:
                await self.sweep()
            except (RedisError, OSError) as exc:  # Redis away: entries stay due, the next tick settles them
                log.warning("silence sweep failed, retrying: %s", exc)
            await asyncio.sleep(self.silence.sweep_interval_seconds)

    async def sweep(self, now: float | None = None) -> SweepCounts:
        """Settle every rollout of every tracked tenant that finished more than the window before ``now``."""
        now = time.time() if now is None else now
        out = SweepCounts()
        for tenant in self.tenants:
            while True:
                due = await self.client.zrangebyscore(
                    self.keys.silence_due(tenant),
                    "-inf",
                    now - self.silence.window_seconds,
                    start=0,
                    num=self.silence.sweep_batch,
                )
                if not due:
                    break
                await self._settle(tenant, [_text(m) for m in due], now, out)
                if len(due) < self.silence.sweep_batch:
                    break
        return out

    async def _settle(self, tenant: str, members: list[str], now: float, out: SweepCounts) -> None:
        """One pipelined read of the batch's records and marks, then one pipelined write of their scripts."""
        parsed = [_parse(m) for m in members]
        reads = self.client.pipeline(transaction=False)
        for digest_rid in parsed:
            if digest_rid is None:
                reads.echo("")  # keeps replies aligned with members
                continue
            digest, rid = digest_rid
            reads.hmget(self.keys.rollouts_by_digest(tenant, digest), [rid, self.keys.rated_field(rid)])
        replies = await reads.execute()
        writes = self.client.pipeline(transaction=False)
        kinds = []
        for member, digest_rid, reply in zip(members, parsed, replies, strict=True):
            args, kind = self._script(tenant, member, digest_rid, reply, now)
            writes.eval(SILENCE_LUA, *args)
            kinds.append(kind)
        for kind, result in zip(kinds, await writes.execute(), strict=True):
            outcome = _outcome(int(result[0]), kind)
            out.add(outcome)
            if self.counter is not None and outcome != TAKEN:
                self.counter.labels(outcome).inc()

    def _script(
        self, tenant: str, member: str, digest_rid: tuple[str, str] | None, reply: list, now: float
    ) -> tuple[list, str]:
        """``numkeys, *keys, *argv`` of SILENCE_LUA for one due member, and what an append would be (trained,
        audited) or why there is nothing to append (invalid; expired or rated are the script's to tell)."""
        due = self.keys.silence_due(tenant)
        if digest_rid is None:  # not "<digest> <rollout_id>": nothing the gateway wrote; remove it, append nothing
            return [2, due, self.keys.rollouts_by_digest(tenant, "-"), member, "", "", "", "0", SILENT], INVALID
        digest, rid = digest_rid
        rollouts = self.keys.rollouts_by_digest(tenant, digest)
        rated_field = self.keys.rated_field(rid)
        raw, rated = reply
        if raw is None or rated is not None:  # gone or rated: the script confirms which, atomically
            return [3, due, rollouts, self.keys.samples, member, rated_field, "", rid, "0", SILENT], EXPIRED
        record = _record(raw)
        if record is None or record.tenant != tenant or record.rollout_id != rid:
            return [3, due, rollouts, self.keys.samples, member, rated_field, "", rid, "0", SILENT], INVALID
        d = decide_silence(record, self.cfg.reward, now)
        stream = self.keys.samples if d.to_samples else self.keys.audit
        keys = [due, rollouts, stream, self.keys.stats(d.version, d.arm)]
        counters = [x for pair in d.counters for x in pair]
        maxlen = "0" if d.to_samples else str(AUDIT_MAXLEN)
        argv = [member, rated_field, d.entry, rid, maxlen, SILENT, *counters]
        return [len(keys), *keys, *argv], TRAINED if d.to_samples else AUDITED


def _outcome(status: int, kind: str) -> str:
    """The sweep result of one script reply (see SILENCE_LUA) given what was attempted."""
    if status == 0:
        return TAKEN
    if status == 2:
        return RATED
    if status == 3:
        return INVALID if kind == INVALID else EXPIRED
    return kind


def _parse(member: str) -> tuple[str, str] | None:
    digest, sep, rid = member.partition(" ")
    if not sep or not digest or not rid or " " in rid:
        return None
    return digest, rid


def _record(raw: bytes | str) -> RolloutRecord | None:
    try:
        return RolloutRecord.model_validate_json(raw)
    except ValueError:
        return None
