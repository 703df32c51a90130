"""The canary A/B decision: promote, roll back or hold a candidate, from per-arm counters. Pure: no I/O, no clock.

Two rates are compared, each with Beta posteriors (``posterior.prob_greater``):

* accept rate = accepted / shown: is a suggestion the user saw better?
* yield = accepted / served ("accepted per 100 requests" / 100): a policy that learns to stay silent can raise its
  accept rate while helping users less (reward hacking, the main production risk Cursor names). A candidate whose
  yield is credibly worse is rolled back even when its accept rate looks better.

Guards against noise and flapping:

* ``min_samples`` shown per arm before any verdict, and ``min_dwell_seconds`` since the candidate started;
* group-sequential looks: a verdict is taken only when the smaller arm has crossed ``min_samples * 2**k`` for a new
  ``k``, not on every tick. Re-testing on every tick inflates false decisions without bound (optional stopping);
  doubling looks bound the number of tests to log2(N / min_samples);
* alpha spending over the looks: look k demands ``1 - (1 - p) / 2**(k+1)`` instead of ``p`` (0.975, 0.9875, ... for
  p = 0.95), so by the union bound the chance of ever promoting (or rolling back) a candidate that is truly equal stays
  below ``1 - p`` however long the canary runs; evidence grows like sqrt(2) per look, so real effects still get through;
* hysteresis: promote needs the promote bar on one rate with neither rate past the rollback bar; rollback needs the
  rollback bar (P(candidate < stable)) on either rate; between the two it holds;
* finality is the controller's part: a candidate gets at most one promote or rollback;
* an equal candidate would hold forever and block newer versions: after ``max_looks`` looks a hold is
  ``inconclusive``, and the controller lets a newer loaded version supersede it (no verdict on its quality).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal

from onlinerl.config import RolloutConfig
from onlinerl.rollout.posterior import BetaPosterior, prob_greater

Action = Literal["promote", "rollback", "hold"]
COUNTER_FIELDS = ("shown", "accepted", "rejected", "empty", "served")


@dataclass(frozen=True)
class ArmStats:
    """The counters of one (version, arm), as in ``stats:v{N}:{arm}`` (gateway: served; feedback: the rest)."""

    shown: int = 0
    accepted: int = 0
    rejected: int = 0
    empty: int = 0
    served: int = 0

    @classmethod
    def from_mapping(cls, raw: Mapping[Any, Any] | None) -> ArmStats:
        """From a Redis HGETALL (bytes or str keys); missing counters are 0, unknown fields ignored."""
        values = {(k.decode() if isinstance(k, bytes) else str(k)): v for k, v in (raw or {}).items()}
        return cls(**{f: int(float(values.get(f) or 0)) for f in COUNTER_FIELDS})

    def minus(self, baseline: ArmStats) -> ArmStats:
        """Counts since ``baseline`` was taken (the stable arm's counters when the candidate started)."""
        return ArmStats(*(max(0, getattr(self, f) - getattr(baseline, f)) for f in COUNTER_FIELDS))

    @property
    def accept_rate(self) -> float:
        return self.accepted / self.shown if self.shown else 0.0

    @property
    def accepted_per_100(self) -> float:
        """Accepted suggestions per 100 served requests; falls back to shown when the gateway counted nothing."""
        requests = max(self.served, self.shown)
        return 100.0 * self.accepted / requests if requests else 0.0

    @property
    def requests(self) -> int:
        return max(self.served, self.shown)


@dataclass(frozen=True)
class DecisionRules:
    min_samples: int = 200
    min_dwell_seconds: float = 300.0
    promote_probability: float = 0.95
    rollback_probability: float = 0.95
    max_looks: int = 5  # holds from look 5 on (32 x min_samples per arm) are inconclusive

    @classmethod
    def from_config(cls, cfg: RolloutConfig) -> DecisionRules:
        return cls(cfg.min_samples, cfg.min_dwell_seconds, cfg.promote_probability, cfg.rollback_probability)

    def inconclusive(self, last_look: int) -> bool:
        """True once the looks tested so far reach ``max_looks`` without a verdict."""
        return last_look >= self.max_looks


@dataclass(frozen=True)
class Verdict:
    """One evaluation. ``evaluated`` is true when a look was tested (worth recording); false for waiting holds."""

    action: Action
    reason: str
    look: int
    evaluated: bool
    p_accept_rate: float
    p_yield: float
    candidate: ArmStats
    stable: ArmStats

    @property
    def samples(self) -> int:
        """Shown suggestions of the smaller arm: what the verdict rests on."""
        return min(self.candidate.shown, self.stable.shown)

    def figures(self) -> dict[str, Any]:
        return {
            "p_accept_rate": round(self.p_accept_rate, 6),
            "p_yield": round(self.p_yield, 6),
            "look": self.look,
            "samples": self.samples,
            "candidate": {
                **asdict(self.candidate),
                "accept_rate": round(self.candidate.accept_rate, 6),
                "accepted_per_100": round(self.candidate.accepted_per_100, 4),
            },
            "stable": {
                **asdict(self.stable),
                "accept_rate": round(self.stable.accept_rate, 6),
                "accepted_per_100": round(self.stable.accepted_per_100, 4),
            },
        }


def look_index(samples: int, min_samples: int) -> int:
    """-1 below ``min_samples``; else k such that ``min_samples * 2**k <= samples < min_samples * 2**(k+1)``."""
    if samples < min_samples:
        return -1
    k = math.floor(math.log2(samples / min_samples))
    while min_samples * 2 ** (k + 1) <= samples:  # guard float rounding at exact powers of two
        k += 1
    while k > 0 and min_samples * 2**k > samples:
        k -= 1
    return k


def look_threshold(probability: float, look: int) -> float:
    """The posterior probability a verdict needs at look ``look`` (geometric alpha spending, see module doc)."""
    return 1.0 - (1.0 - probability) / 2 ** (look + 1)


def win_probabilities(candidate: ArmStats, stable: ArmStats) -> tuple[float, float]:
    """(P(candidate accept rate >= stable's), P(candidate yield >= stable's))."""
    p_rate = prob_greater(
        BetaPosterior.from_counts(stable.accepted, stable.shown),
        BetaPosterior.from_counts(candidate.accepted, candidate.shown),
    )
    p_yield = prob_greater(
        BetaPosterior.from_counts(stable.accepted, stable.requests),
        BetaPosterior.from_counts(candidate.accepted, candidate.requests),
    )
    return p_rate, p_yield


def decide(
    candidate: ArmStats, stable: ArmStats, dwell_seconds: float, last_look: int, rules: DecisionRules
) -> Verdict:
    """Promote, roll back or hold, given counters since the candidate started and the last look already tested."""
    p_rate, p_yield = win_probabilities(candidate, stable)
    n = min(candidate.shown, stable.shown)
    look = look_index(n, rules.min_samples)

    def verdict(action: Action, reason: str, evaluated: bool) -> Verdict:
        return Verdict(action, reason, look, evaluated, p_rate, p_yield, candidate, stable)

    if look < 0:
        return verdict("hold", f"collecting samples: {n} of {rules.min_samples} shown in the smaller arm", False)
    if dwell_seconds < rules.min_dwell_seconds:
        return verdict("hold", f"dwell: {dwell_seconds:.0f} s of {rules.min_dwell_seconds:.0f} s", False)
    if look <= last_look:
        nxt = rules.min_samples * 2 ** (last_look + 1)
        return verdict("hold", f"between looks: next look at {nxt} shown per arm (now {n})", False)
    worse = look_threshold(rules.rollback_probability, look)
    if 1.0 - p_rate >= worse:
        return verdict("rollback", f"accept rate worse: P(candidate < stable) = {1 - p_rate:.4f} >= {worse:.4f}", True)
    if 1.0 - p_yield >= worse:
        return verdict(
            "rollback",
            f"accepted per 100 requests worse (a quieter policy does not win): "
            f"P(candidate < stable) = {1 - p_yield:.4f} >= {worse:.4f}",
            True,
        )
    better = look_threshold(rules.promote_probability, look)
    if p_rate >= better:
        return verdict("promote", f"accept rate better: P(candidate >= stable) = {p_rate:.4f} >= {better:.4f}", True)
    if p_yield >= better:
        return verdict(
            "promote", f"accepted per 100 requests better: P(candidate >= stable) = {p_yield:.4f} >= {better:.4f}", True
        )
    return verdict(
        "hold", f"within noise at look {look}: P(accept rate) = {p_rate:.4f}, P(yield) = {p_yield:.4f}", True
    )
