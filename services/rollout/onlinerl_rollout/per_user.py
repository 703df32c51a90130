"""Canary statistics that one key cannot steer: a per-user cap at each look, and no verdict that rests on one user.

The arm counters (``stats:v{N}:{arm}``) add every user's traffic together, so one API key that sends enough could
decide a look alone: within the default 1,000 samples per user-hour, one key fills a first look of 30 shown per arm,
and one that rejects (or accepts) everything it is shown drags its arm's rates as far as it likes. The gateway and
feedback also count each canary's rollouts per served user (``Keys.arm_users``: the served key's ``user_hash``, never
a client-sent id), and at each look the controller

1. **caps** each user's contribution: at look k (``min_samples * 2**k`` shown in the smaller arm) a user counts for
   at most ``max_user_share`` of that look's shown suggestions, and of the requests they take in its arm (its
   counters are scaled down by one factor, so its own rates are kept, only its weight is bounded). The look is the
   largest k whose capped counts reach it: a look needs at least ``1 / max_user_share`` users in each arm, and one
   user alone never reaches any;
2. **leaves each user out**: a promote or rollback must be the verdict of the same look with any single user's
   capped counters removed (from either arm). A verdict that flips without one user rests on that user, and the look
   is a ``hold`` that names it. So a key rejecting everything, or accepting everything, can delay a verdict (as any
   noise can) but never decide one. The users tried are the ``MAX_LEFT_OUT`` with the largest capped traffic, the
   only ones whose removal can move a figure far (each holds at most ``max_user_share`` of a look).

The anomaly quarantine (feedback, limits.py) is the other half: a key far above or below its tenant stops counting
at all. Without a ledger (counters written before the ledgers existed) the controller decides on the arm counters,
as before.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from onlinerl.rollout.records import COUNTER_FIELDS, ArmStats
from onlinerl_rollout.decision import Verdict, look_index

MAX_LEFT_OUT = 64  # users tried by the leave-one-out check, the heaviest first

Users = Mapping[str, ArmStats]
# (candidate, stable, at_look) -> verdict: the decision function with everything else bound (decision.decide_canary)
DecideAt = Callable[[ArmStats, ArmStats, int | None], Verdict]


def total(users: Users) -> ArmStats:
    """The users' counters added up."""
    return ArmStats(*(sum(getattr(u, f) for u in users.values()) for f in COUNTER_FIELDS))


def _scaled(s: ArmStats, factor: float) -> ArmStats:
    return s if factor >= 1.0 else ArmStats(*(math.floor(getattr(s, f) * factor) for f in COUNTER_FIELDS))


def capped_users(users: Users, look: int, min_samples: int, share: float) -> dict[str, ArmStats]:
    """Each user scaled down to at most ``share`` of look ``look``'s shown suggestions, and of the requests that
    many shown take in this arm (its served per shown)."""
    arm = total(users)
    cap_shown = math.ceil(share * min_samples * 2**look)
    cap_requests = math.ceil(cap_shown * arm.requests / arm.shown) if arm.shown else cap_shown
    out = {}
    for user, s in users.items():
        factor = min(1.0, cap_shown / s.shown if s.shown else 1.0, cap_requests / s.requests if s.requests else 1.0)
        out[user] = _scaled(s, factor)
    return out


@dataclass(frozen=True)
class Capped:
    """The look the capped counters reach (-1: none) and, per arm, each user's capped counters (``stable`` None:
    blue/green's frozen snapshot, which has no users)."""

    look: int
    candidate: dict[str, ArmStats]
    stable: dict[str, ArmStats] | None


def cap_at_looks(
    candidate: Users, stable: Users | None, stable_total: ArmStats, min_samples: int, share: float
) -> Capped:
    """The largest look k whose per-user-capped counts reach ``min_samples * 2**k`` shown in the smaller arm."""
    raw = min(total(candidate).shown, (total(stable) if stable is not None else stable_total).shown)
    for k in range(look_index(raw, min_samples), -1, -1):
        cand = capped_users(candidate, k, min_samples, share)
        stab = capped_users(stable, k, min_samples, share) if stable is not None else None
        n = min(total(cand).shown, (total(stab) if stab is not None else stable_total).shown)
        if look_index(n, min_samples) >= k:
            return Capped(k, cand, stab)
    first = capped_users(stable, 0, min_samples, share) if stable is not None else None
    return Capped(-1, capped_users(candidate, 0, min_samples, share), first)  # no look: capped as for the first


def _heaviest(c: Capped) -> list[tuple[str, str]]:
    """(arm, user) pairs by capped traffic, heaviest first, at most ``MAX_LEFT_OUT``."""
    pairs = [("candidate", u, s) for u, s in c.candidate.items()]
    pairs += [("stable", u, s) for u, s in (c.stable or {}).items()]
    pairs.sort(key=lambda p: (-(p[2].shown + p[2].requests), p[0], p[1]))
    return [(arm, user) for arm, user, _ in pairs[:MAX_LEFT_OUT]]


def robust_verdict(
    decide_at: DecideAt, candidate: Users, stable: Users | None, stable_total: ArmStats, min_samples: int, share: float
) -> Verdict:
    """The verdict on per-user-capped counters, turned into a ``hold`` when it rests on one user (module doc).
    ``stable`` None: blue/green, compared with the frozen snapshot ``stable_total`` (only candidate users are capped
    and left out)."""
    c = cap_at_looks(candidate, stable, stable_total, min_samples, share)
    cand = total(c.candidate)
    stab = total(c.stable) if c.stable is not None else stable_total
    v = decide_at(cand, stab, None)
    raw = min(total(candidate).shown, (total(stable) if stable is not None else stable_total).shown)
    if c.look < 0 and look_index(raw, min_samples) >= 0:  # the raw counts reach a look, the capped ones none
        return replace(v, reason=f"{v.reason} (per-user capped: one user counts for at most {share:g} of a look)")
    if not v.evaluated or v.action == "hold":
        return v
    for arm, user in _heaviest(c):
        if arm == "candidate":
            without = decide_at(cand.minus(c.candidate[user]), stab, v.look)
        else:
            assert c.stable is not None
            without = decide_at(cand, stab.minus(c.stable[user]), v.look)
        if without.action != v.action:
            return replace(
                v,
                action="hold",
                kept=False,
                reason=f"{v.action} rests on one user: without user {user[:12]} ({arm} arm) the look says "
                f"{without.action} ({without.reason}); held at look {v.look}",
            )
    return v


def per_user_summary(users: Users) -> dict[str, int]:
    """How many users an arm's ledger holds and the largest one's shown/served (decision figures)."""
    if not users:
        return {"users": 0}
    top = max(users.values(), key=lambda s: (s.shown, s.requests))
    return {"users": len(users), "top_user_shown": top.shown, "top_user_requests": top.requests}
