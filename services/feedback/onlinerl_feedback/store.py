"""Redis side of the feedback service: read a tenant's rollouts, append one decision atomically.

The append is one Lua script (``onlinerl.dataplane.samples.APPEND``; docs/architecture.md, "Delivery guarantees"):
dedupe check, rated check, XADD, the ``seen`` and ``rated`` marks and the stats counters happen together or not at
all, and with ``appendfsync always`` the script's effects are on disk before Redis replies (a crash mid-write leaves
an incomplete MULTI block at the AOF tail, which Redis discards on load). So an event can never be marked seen without
its entry, a rollout can never be rated twice (the check and the mark are one atomic step), and an acknowledged entry
is never lost.

A duplicate (seen ``completionId``, or a rollout rated between our read and the script) is audited with a second,
plain write: it costs a round trip only for the duplicate itself, never on the first delivery.

The same script applies the per-user contribution limit and quarantine (limits.py): an event whose user may not
contribute goes to ``audit`` instead, in the same atomic step, so no burst of concurrent events can slip past a limit.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from onlinerl.config import FeedbackLimitsConfig
from onlinerl.dataplane import audit, samples
from onlinerl.dataplane.audit import AUDIT_MAXLEN
from onlinerl.dataplane.rollouts import LEDGER_TTL_SECONDS, Rollouts, ledger_for, parse_rollouts, rollouts_command
from onlinerl.keys import Keys
from onlinerl.schemas import CompletionOutcome

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

__all__ = ["AUDIT_MAXLEN", "AppendResult", "FeedbackStore"]  # AUDIT_MAXLEN: the silence sweeper imports it from here

LIMITED, QUARANTINED_REPLY = 3, 4  # script replies: audited because over the limit / quarantined (samples.APPEND)


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
        """Every live rollout recorded for this tenant and prompt, and the rated marks of the same hash (one
        HGETALL; onlinerl/dataplane/rollouts.py)."""
        return parse_rollouts(await self._reads.call(*rollouts_command(self._keys, tenant, prompt)))

    async def audit(self, entry: bytes) -> str:
        """One capped audit entry for an upload that is never trained (a Continue event without its code, or of a
        schema version we do not know: envelope.py); its entry id."""
        return await audit.append(self._p, self._keys, entry)

    async def append(
        self,
        event: CompletionOutcome,
        tenant: str,
        prompt: str,
        decision: Decision,
        user: str = ANONYMOUS_USER,
        sender: str = "",
    ) -> AppendResult:
        """Append ``decision`` atomically, or audit it if ``user`` is quarantined or over its contribution limit
        (limits.py); a duplicate is audited instead (see the module doc)."""
        # A key slot the script leaves alone still names a key feedback may write: Redis checks every declared key
        # of a script against the caller's ACL user as read+write (onlinerl/dataplane/acl.py).
        unused = self._keys.audit
        # the served line's counters (issue 39): the shared line's, or the rating tenant's own project line's; a
        # decision naming any other line counts nowhere (decide.FOREIGN_LINE audits such a record first)
        own = decision.line in ("", tenant)
        counted = bool(decision.rates and decision.counters and decision.version is not None and own)
        line = self._keys.for_line(decision.line if own else "")
        limit = limit_args(self._keys, self._limits, event, tenant, user, prompt, decision, sender=sender)
        ledger = (
            ledger_for(line, decision.version, decision.arm, decision.canary, decision.served_user)
            if counted and decision.version is not None
            else None
        )
        keys = [
            self._keys.seen(tenant, event.completion_id),
            self._keys.samples if decision.to_samples else self._keys.audit,
            self._keys.audit,
            self._keys.rollouts(tenant, prompt) if decision.rates else unused,
            line.stats(decision.version, decision.arm) if counted else unused,
            *limit.keys,
            ledger[0] if ledger else unused,
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
            f"{ledger[1]}:" if ledger else "",
            str(LEDGER_TTL_SECONDS),
        ]
        if counted:
            argv += [x for pair in decision.counters for x in pair]  # only a rated event bumps counters
        status, value, fresh = await samples.append(self._p, keys, argv)
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
            dup = duplicate(event, tenant, prompt, ROLLOUT_ALREADY_RATED, value, rid, sender=sender)
            return await self.append(event, tenant, prompt, dup, user, sender)
        # completionId recorded before: the verdict stands; this delivery is audited only (a plain capped XADD).
        outcome, _, entry_id = value.partition(" ")
        entry = audit_entry(
            event, tenant, prompt, DUPLICATE, COMPLETION_ID_SEEN, time.time(), decision.rates, value, sender
        )
        audit_id = await audit.append(self._p, self._keys, entry)
        return AppendResult(False, outcome, entry_id, COMPLETION_ID_SEEN, audit_id)
