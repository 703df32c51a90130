"""The silence sweeper: turns each served rollout that got no outcome in time into exactly one silence outcome.

The gateway's record script adds every rollout of a tenant with ``feedback.silence`` on to ``silence:{tenant}``
(scored by finish time; onlinerl/keys.py). Each tick this task takes the entries older than the window, reads their
records, decides what silence means for each (silence.py, pure) and settles each in one Lua script
(onlinerl/dataplane/rollouts.py, SETTLE_SILENCE): remove the due entry (if another sweeper, a second worker or
replica, removed it first, stop), check the rollout's ``rated:`` mark (a real outcome came first: skip), check the
record still exists (it expired or was evicted: skip), then XADD, set the mark and bump ``silent``. The rated check
and mark are the same field the feedback append script checks and sets atomically (store.py), so a rollout gets a
real rating or a silence outcome, never both, and a client's late outcome is a ``duplicate`` of the silence. A
crash before the script leaves the entry due; the next tick settles it.

A silence outcome is produced by the server, not by a user: it never counts against a user's contribution limit nor
its accept-rate statistics (limits.py).
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
from onlinerl.dataplane import rollouts
from onlinerl.dataplane.rollouts import GONE, RATED_FIRST, TAKEN_BY_OTHER, DueRead, Settle
from onlinerl.keys import Keys
from onlinerl.schemas import RolloutRecord

from .decide import own_line
from .silence import SILENT, decide_silence
from .store import AUDIT_MAXLEN

log = logging.getLogger("onlinerl_feedback.silence")

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
        batch = self.silence.sweep_batch
        for tenant in self.tenants:
            while True:
                due = await rollouts.due_members(
                    self.client, self.keys, tenant, now - self.silence.window_seconds, batch
                )
                if not due:
                    break
                await self._settle(tenant, due, now, out)
                if len(due) < batch:
                    break
        return out

    async def _settle(self, tenant: str, members: list[str], now: float, out: SweepCounts) -> None:
        """One pipelined read of the batch's records and marks, then one pipelined write of their settle steps."""
        parsed = [rollouts.parse_member(m) for m in members]
        reads = await rollouts.read_due(self.client, self.keys, tenant, parsed)
        steps = [self._step(tenant, m, p, r, now) for m, p, r in zip(members, parsed, reads, strict=True)]
        statuses = await rollouts.settle_silences(self.client, self.keys, tenant, [s for s, _ in steps])
        for (_, kind), status in zip(steps, statuses, strict=True):
            outcome = _outcome(status, kind)
            out.add(outcome)
            if self.counter is not None and outcome != TAKEN:
                self.counter.labels(outcome).inc()

    def _step(
        self, tenant: str, member: str, digest_rid: tuple[str, str] | None, read: DueRead, now: float
    ) -> tuple[Settle, str]:
        """The settle step for one due member, and what an append would be (trained, audited) or why there is
        nothing to append (invalid; expired or rated are the script's to tell, atomically)."""
        if digest_rid is None:  # not "<digest> <rollout_id>": nothing the gateway wrote; remove it, append nothing
            return Settle(member, outcome=SILENT), INVALID
        digest, rid = digest_rid
        nothing = Settle(member, rid, digest, outcome=SILENT)
        if read.raw is None or read.rated is not None:  # gone or rated: the script confirms which, atomically
            return nothing, EXPIRED
        record = _record(read.raw)
        if record is None or record.tenant != tenant or record.rollout_id != rid or not own_line(record, tenant):
            return nothing, INVALID  # a record naming another project's line is never counted there (issue 39)
        d = decide_silence(record, self.cfg.reward, now)
        step = Settle(
            member,
            rid,
            digest,
            entry=d.entry,
            stream=self.keys.samples if d.to_samples else self.keys.audit,
            stats=self.keys.for_line(d.line).stats(d.version, d.arm),
            maxlen=0 if d.to_samples else AUDIT_MAXLEN,
            outcome=SILENT,
            counters=tuple(d.counters),
        )
        return step, TRAINED if d.to_samples else AUDITED


def _outcome(status: int, kind: str) -> str:
    """The sweep result of one settle reply (onlinerl/dataplane/rollouts.py, SETTLE_SILENCE) given what was tried."""
    if status == TAKEN_BY_OTHER:
        return TAKEN
    if status == RATED_FIRST:
        return RATED
    if status == GONE:
        return INVALID if kind == INVALID else EXPIRED
    return kind


def _record(raw: bytes | str) -> RolloutRecord | None:
    try:
        return RolloutRecord.model_validate_json(raw)
    except ValueError:
        return None
