"""Contribution limits and quarantine: what the append script needs to decide, per event, atomically.

A *user* is one API key (``Identity.key_id``: clients make up their unique ids, so only the key identifies anyone;
anonymous traffic is one user, ``anonymous``). An event *contributes* when it would be trained on or counted in a
canary arm's stats. A silence outcome (sweeper.py) is no user's event: the server produces it for a rollout nobody
reported, so it never passes this step and never counts against a limit or the anomaly test. For a contributing
event the append script (store.py) checks, in the same step as the XADD:

1. quarantined (key ``quarantine:{tenant}:{user}`` exists): audited with reason ``quarantined``;
2. over ``feedback.limits.maxSamplesPerUserPerHour`` in this clock hour (counter ``contrib:{tenant}:{user}:{hour}``):
   audited with reason ``contribution_limit``;
3. otherwise appended as decided, then the user's and the tenant's ``shown``/``accepted`` counters are bumped and the
   anomaly test runs: with at least ``anomalyMinShown`` rated suggestions for the user and for the rest of the
   tenant, a user whose accept rate is more than ``anomalyK`` binomial sigmas above *or below* the rest's is
   quarantined (a key that rejects everything steers a canary as surely as one that accepts everything), and its
   counts leave the tenant's totals (the outlier must not become the baseline the others are tested against). Below
   needs more evidence than above: at the tenant's rate p, a user who accepts nothing is caught after about
   k^2 (1 - p) / p rated suggestions (144 at p = 0.1, k = 4).

Either way the event is acknowledged (200, ``status: rejected`` + ``reason``): it was received and recorded, and a 429
would only make a client retry an event that will never count. Releasing a user (``release``) deletes the mark and the
user's counters, so the test starts afresh; audited events stay audited (they are not replayed).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from onlinerl.config import FeedbackLimitsConfig
from onlinerl.dataplane import limits as dataplane_limits
from onlinerl.keys import Keys
from onlinerl.schemas import CompletionOutcome

from .decide import CONTRIBUTION_LIMIT, QUARANTINED, REJECTED, Decision, audit_entry

ANONYMOUS_USER = "anonymous"
HOUR = 3600


def user_of(key_id: str) -> str:
    """The user an event counts for: the key's id, or ``anonymous`` for keyless traffic (one shared user)."""
    return key_id or ANONYMOUS_USER


@dataclass(frozen=True)
class LimitArgs:
    """Keys and script arguments of the limit/quarantine step for one event (``subject`` False: not checked)."""

    keys: tuple[str, str, str, str]  # contrib counter, quarantine mark, user stats, tenant stats
    argv: tuple[Any, ...]


def limit_args(
    keys: Keys,
    cfg: FeedbackLimitsConfig,
    event: CompletionOutcome,
    tenant: str,
    user: str,
    prompt: str,
    decision: Decision,
    now: float | None = None,
    sender: str = "",
) -> LimitArgs:
    """Script keys and ARGV for the limit step; an event that contributes nothing passes ``subject = 0``.
    ``sender``: the key's user hash, on the audit entry of an event over a limit (`onlinerl forget` finds it)."""
    now = time.time() if now is None else now
    ks = (
        keys.contrib(tenant, user, int(now // HOUR)),
        keys.quarantine(tenant, user),
        keys.user_stats(tenant, user),
        keys.user_stats(tenant),
    )
    if not decision.contributes:
        return LimitArgs(ks, ("0", "0", "", "", "0", "0", "0", "0", "0", REJECTED))
    counts = dict(decision.counters)
    rid = decision.rates

    def audited(reason: str) -> bytes:
        return audit_entry(event, tenant, prompt, REJECTED, reason, now, rid, sender=sender)

    return LimitArgs(
        ks,
        (
            "1",
            str(cfg.max_samples_per_user_per_hour),
            audited(CONTRIBUTION_LIMIT),
            audited(QUARANTINED),
            repr(float(cfg.anomaly_k)),
            str(cfg.anomaly_min_shown),
            str(cfg.anomaly_window_seconds),
            str(counts.get("shown", 0)),
            str(counts.get("accepted", 0)),
            REJECTED,
        ),
    )


async def release(redis: Any, keys: Keys, tenant: str, user: str) -> bool:
    """Release a quarantined user (an admin's decision): drop the mark and the user's counters. True if it was set."""
    return await dataplane_limits.release(redis, keys, tenant, user)
