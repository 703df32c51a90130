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
* guardrails (``rollout.guardrails``) against reward hacking: suggestion rate (shown / served), accepted characters
  per 100 requests, mean shown length and empty rate, each against a floor relative to stable. A point figure past
  its floor at a look blocks promotion (hold), so a candidate that is shorter and accepted more often, but leaves
  users fewer accepted characters, is never promoted. It rolls back when the breach is credible: the posterior
  probability of the breach passes the same alpha-spent rollback bar as the rates (a truly equal candidate is not
  rolled back on noise); mean length, which has no posterior here, after ``breach_looks`` consecutive looks;
* finality is the controller's part: a candidate gets at most one promote or rollback;
* an equal candidate would hold forever and block newer versions: after ``max_looks`` looks a hold is
  ``inconclusive``. ``decide_canary`` then keeps it (a *kept* promotion, ``on_inconclusive: promote``) when it
  shows no sign of regression: both rates' P(candidate >= stable) at least one half and no guardrail broken. It
  passed the eval gate offline (not worse than stable by more than the gate's margins), and live traffic found
  nothing against it, the same evidence on which blue/green keeps a version at the end of its watch window. This
  is no proven win, and the reason says so: the alpha-spending bound above is for *wins*; a truly equal candidate
  is kept about a quarter of the time (harmless: it is equal), and a worse one needs the gate's margins and the
  live point estimates to miss it. Without such a sign, or with ``on_inconclusive: supersede``, the controller lets
  a newer loaded version supersede it (no verdict on its quality). On thin traffic (2 CPU cores, a few requests a
  minute) no look can prove a realistic improvement, and a stable that never moves keeps users, and the trainer's
  samples, on the base policy: the kept promotion is what lets the loop advance there;
* a drift guard on kept promotions (``DriftGuard``): "no sign of regression against the current stable" alone lets
  small regressions compound, each kept version a little worse than the one before, each within noise of its
  predecessor. So a kept promotion (canary, or blue/green's keep at the end of its watch) must also not be credibly
  worse, on either rate, than the *anchor*: the last stable that was a proven win (a promotion on a credible
  improvement), or the base or whatever stable the kept chain started from, compared with the anchor's own lifetime
  stable-arm figures at this look's rollback bar. And at most ``max_kept_in_a_row`` kept promotions follow one
  another: past that, only a proven win moves stable (an inconclusive canary candidate is superseded, a blue/green
  one switched back). The comparison with the anchor crosses time (its figures were measured on earlier traffic),
  so it is only a backstop against a large cumulative drift; the bound is what holds on thin traffic, where no
  comparison is ever credible.

Blue/green (``decide_watch``): one version serves everyone, so there is no live stable arm; the same ``decide``
compares the candidate with a frozen snapshot of stable's counters taken at the switch. The snapshot's shown count
caps the looks (the smaller arm stops growing), so the watch window ends at the last look it allows (or
``max_looks``): a hold there keeps the candidate ("no live regression") unless a guardrail point figure is still
broken, which switches back. Promote and rollback before the end are ``decide``'s, with its alpha spending.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Literal

from onlinerl.config import GuardrailConfig, RolloutConfig
from onlinerl.rollout.records import ArmStats
from onlinerl_rollout.posterior import BetaPosterior, prob_greater

Action = Literal["promote", "rollback", "hold"]


@dataclass(frozen=True)
class Guardrails:
    """Floors relative to stable (see ``GuardrailConfig``)."""

    min_suggestion_rate_ratio: float = 0.8
    min_accepted_chars_ratio: float = 0.9
    min_shown_length_ratio: float = 0.25
    max_empty_rate_increase: float = 0.1
    breach_looks: int = 2

    @classmethod
    def from_config(cls, cfg: GuardrailConfig) -> Guardrails:
        return cls(
            cfg.min_suggestion_rate_ratio,
            cfg.min_accepted_chars_ratio,
            cfg.min_shown_length_ratio,
            cfg.max_empty_rate_increase,
            cfg.breach_looks,
        )


@dataclass(frozen=True)
class Breach:
    """One broken guardrail: its reason, and P(the candidate's true figure is below the floor) where the counters
    allow a posterior (rates of Bernoulli events), else None (mean length)."""

    reason: str
    probability: float | None


def prob_below(cand_successes: int, cand_trials: int, ratio: float, stable_successes: int, stable_trials: int) -> float:
    """P(p_candidate < ratio * p_stable) for Beta(1, 1) posteriors, normal approximation (ratio != 1: no exact sum)."""
    c = BetaPosterior.from_counts(cand_successes, cand_trials)
    s = BetaPosterior.from_counts(stable_successes, stable_trials)
    sd = math.sqrt(c.variance + ratio * ratio * s.variance)
    return 0.5 * math.erfc((c.mean - ratio * s.mean) / (sd * math.sqrt(2.0)))


def accepted_length_ratio(
    cand_accepted: float, cand_chars: float, stable_accepted: float, stable_chars: float
) -> float | None:
    """Stable's mean accepted length over the candidate's, or None when either accepted nothing.

    Accepted characters per request = yield x mean accepted length, and the noise is in the yield (a Bernoulli
    rate; the lengths are averages of many suggestions), so "accepted characters below floor x stable's" is tested
    as "yield below floor x this ratio x stable's yield". One definition for the live guardrail and the eval gate;
    counts or per-request rates alike (each side's scale cancels)."""
    if cand_accepted <= 0 or stable_accepted <= 0 or cand_chars <= 0:
        return None
    return (stable_chars / stable_accepted) / (cand_chars / cand_accepted)


def guardrail_breaches(candidate: ArmStats, stable: ArmStats, g: Guardrails) -> list[Breach]:
    """Every guardrail whose point figure is past its floor. Character guardrails are skipped while stable has no
    character counts (a feedback service that does not count them yet).

    Accepted characters per request = yield x mean accepted length; its uncertainty is dominated by the yield (a
    Bernoulli rate), so its breach probability is that of ``yield_c < floor * (len_s / len_c) * yield_s``, with the
    mean lengths taken as known (they are averages of many suggestions)."""
    out: list[Breach] = []
    c, s = candidate, stable
    if c.suggestion_rate < g.min_suggestion_rate_ratio * s.suggestion_rate:
        p = prob_below(c.shown, c.requests, g.min_suggestion_rate_ratio, s.shown, s.requests)
        out.append(
            Breach(
                f"suggestion rate {c.suggestion_rate:.3f} < {g.min_suggestion_rate_ratio} x stable "
                f"{s.suggestion_rate:.3f}",
                p,
            )
        )
    if s.accepted_chars > 0 and c.accepted_chars_per_100 < g.min_accepted_chars_ratio * s.accepted_chars_per_100:
        lengths = accepted_length_ratio(c.accepted, c.accepted_chars, s.accepted, s.accepted_chars)
        p = (
            prob_below(c.accepted, c.requests, g.min_accepted_chars_ratio * lengths, s.accepted, s.requests)
            if lengths is not None
            else prob_below(c.accepted, c.requests, 1.0, s.accepted, s.requests)
        )
        out.append(
            Breach(
                f"accepted chars per 100 requests {c.accepted_chars_per_100:.1f} < {g.min_accepted_chars_ratio} "
                f"x stable {s.accepted_chars_per_100:.1f}",
                p,
            )
        )
    if s.shown_chars > 0 and c.mean_shown_length < g.min_shown_length_ratio * s.mean_shown_length:
        out.append(
            Breach(
                f"mean shown length {c.mean_shown_length:.1f} chars < {g.min_shown_length_ratio} x stable "
                f"{s.mean_shown_length:.1f}",
                None,
            )
        )
    if c.empty_rate > s.empty_rate + g.max_empty_rate_increase:
        rated_c, rated_s = c.shown + c.empty, s.shown + s.empty
        # P(non-empty share of the candidate < stable's - allowance), as a ratio of the stable's non-empty share
        s_ok = 1.0 - s.empty_rate
        ratio = max(0.0, (s_ok - g.max_empty_rate_increase) / s_ok) if s_ok > 0 else 0.0
        p = prob_below(c.shown, rated_c, ratio, s.shown, rated_s)
        out.append(
            Breach(f"empty rate {c.empty_rate:.3f} > stable {s.empty_rate:.3f} + {g.max_empty_rate_increase}", p)
        )
    return out


@dataclass(frozen=True)
class DecisionRules:
    min_samples: int = 200
    min_dwell_seconds: float = 300.0
    promote_probability: float = 0.95
    rollback_probability: float = 0.95
    max_looks: int = 5  # holds from look 5 on (32 x min_samples per arm) are inconclusive
    guardrails: Guardrails = Guardrails()
    on_inconclusive: Literal["promote", "supersede"] = "promote"
    max_kept_in_a_row: int = 3  # kept promotions in a row without a proven win (DriftGuard)
    max_user_share: float = 0.25  # of a look, per user and arm (per_user.py)

    @classmethod
    def from_config(cls, cfg: RolloutConfig) -> DecisionRules:
        return cls(
            cfg.min_samples,
            cfg.min_dwell_seconds,
            cfg.promote_probability,
            cfg.rollback_probability,
            cfg.max_looks,
            guardrails=Guardrails.from_config(cfg.guardrails),
            on_inconclusive=cfg.on_inconclusive,
            max_kept_in_a_row=cfg.max_kept_in_a_row,
            max_user_share=cfg.max_user_share,
        )

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
    breaches: tuple[str, ...] = ()
    breach_looks: int = 0  # consecutive evaluated looks with a guardrail breach, this one included
    kept: bool = False  # a promotion without a proven win (kept at the last look / the end of the watch)

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
            "guardrail_breaches": list(self.breaches),
            "guardrail_breach_looks": self.breach_looks,
            "candidate": self.candidate.summary(),
            "stable": self.stable.summary(),
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
    candidate: ArmStats,
    stable: ArmStats,
    dwell_seconds: float,
    last_look: int,
    rules: DecisionRules,
    breach_looks: int = 0,
    at_look: int | None = None,
) -> Verdict:
    """Promote, roll back or hold, given counters since the candidate started, the last look already tested and the
    number of consecutive looks before this one that broke a guardrail. ``at_look``: test these counters at that
    look whatever their size (the per-user check, per_user.py: the same look's verdict with one user left out)."""
    p_rate, p_yield = win_probabilities(candidate, stable)
    n = min(candidate.shown, stable.shown)
    look = look_index(n, rules.min_samples) if at_look is None else at_look
    breaches: tuple[str, ...] = ()

    def verdict(action: Action, reason: str, evaluated: bool) -> Verdict:
        streak = (breach_looks + 1 if breaches else 0) if evaluated else breach_looks
        return Verdict(action, reason, look, evaluated, p_rate, p_yield, candidate, stable, breaches, streak)

    if look < 0:
        return verdict("hold", f"collecting samples: {n} of {rules.min_samples} shown in the smaller arm", False)
    if dwell_seconds < rules.min_dwell_seconds and at_look is None:
        return verdict("hold", f"dwell: {dwell_seconds:.0f} s of {rules.min_dwell_seconds:.0f} s", False)
    if look <= last_look and at_look is None:
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
    found = guardrail_breaches(candidate, stable, rules.guardrails)
    breaches = tuple(b.reason for b in found)
    if found:
        streak = breach_looks + 1
        credible = [b for b in found if b.probability is not None and b.probability >= worse]
        persistent = [b for b in found if b.probability is None and streak >= rules.guardrails.breach_looks]
        if credible or persistent:
            why = "; ".join(
                [f"{b.reason} (P = {b.probability:.4f} >= {worse:.4f})" for b in credible]
                + [f"{b.reason} (at {streak} consecutive looks)" for b in persistent]
            )
            return verdict("rollback", f"guardrail broken: {why}", True)
        return verdict("hold", f"guardrail broken, not promoted (look {look}): {'; '.join(breaches)}", True)
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


NO_SIGN_OF_REGRESSION = 0.5  # P(candidate >= stable) on both rates: the live point estimates are not worse


@dataclass(frozen=True)
class DriftGuard:
    """Where the current stable stands in its chain of kept promotions (module doc): ``kept_in_a_row`` kept
    promotions lead from ``anchor`` (the last proven stable, or where the chain starts) to the current stable;
    ``anchor_stats``: the anchor's lifetime stable-arm counters (None: no anchor to compare with, or it is the
    current stable itself)."""

    kept_in_a_row: int = 0
    anchor: int | None = None
    anchor_stats: ArmStats | None = None


def drift_block(v: Verdict, drift: DriftGuard | None, rules: DecisionRules) -> str | None:
    """Why a kept promotion may not happen (the drift guard), or None when it may."""
    if drift is None:
        return None
    anchor = f"v{drift.anchor}" if drift.anchor is not None else "the chain's start"
    if drift.kept_in_a_row >= rules.max_kept_in_a_row:
        return (
            f"not kept: {drift.kept_in_a_row} kept promotions in a row since the last proven stable {anchor} "
            f"(rollout.maxKeptInARow {rules.max_kept_in_a_row}); only a proven win moves stable now"
        )
    a = drift.anchor_stats
    if a is None or a.shown < rules.min_samples:
        return None
    p_rate, p_yield = win_probabilities(v.candidate, a)
    worse = look_threshold(rules.rollback_probability, max(v.look, 0))
    if 1.0 - p_rate >= worse or 1.0 - p_yield >= worse:
        return (
            f"not kept: credibly worse than the last proven stable {anchor} (its figures as stable: accept rate "
            f"{a.accept_rate:.3f}, accepted per 100 {a.accepted_per_100:.1f}; P(candidate < it) = "
            f"{1 - p_rate:.4f} / {1 - p_yield:.4f}, bar {worse:.4f})"
        )
    return None


def decide_canary(
    candidate: ArmStats,
    stable: ArmStats,
    dwell_seconds: float,
    last_look: int,
    rules: DecisionRules,
    breach_looks: int = 0,
    gated: bool = True,
    drift: DriftGuard | None = None,
    at_look: int | None = None,
) -> Verdict:
    """The canary's verdict: ``decide``, and at the last look a within-noise hold with no sign of regression is
    kept (promoted) under ``on_inconclusive: promote``, unless the drift guard says no (module doc). ``gated``: the
    candidate passed the eval gate (``rollout.gate.enabled``), which the reason states."""
    v = decide(candidate, stable, dwell_seconds, last_look, rules, breach_looks, at_look)
    if rules.on_inconclusive != "promote" or not v.evaluated or v.action != "hold" or v.breaches:
        return v
    if v.look < rules.max_looks:
        return v
    if v.p_accept_rate < NO_SIGN_OF_REGRESSION or v.p_yield < NO_SIGN_OF_REGRESSION:
        return v
    blocked = drift_block(v, drift, rules)
    if blocked is not None:
        return replace(v, reason=f"{v.reason}; {blocked}")
    gate = "passed the eval gate" if gated else "no eval gate (disabled)"
    figures = f"P(accept rate) = {v.p_accept_rate:.4f}, P(yield) = {v.p_yield:.4f}, both >= {NO_SIGN_OF_REGRESSION}"
    return replace(
        v,
        action="promote",
        kept=True,
        reason=f"kept at the last look ({v.look}, {v.samples} shown per arm): {gate}, no sign of live regression "
        f"({figures}; no guardrail broken); within noise, not a proven win",
    )


def watch_last_look(baseline: ArmStats, rules: DecisionRules) -> int:
    """The last look a blue/green watch takes: where the frozen snapshot's shown count stops the looks, at most
    ``max_looks`` (-1: the snapshot is below ``min_samples``, no look is possible)."""
    return min(rules.max_looks, look_index(baseline.shown, rules.min_samples))


def decide_watch(
    candidate: ArmStats,
    baseline: ArmStats,
    dwell_seconds: float,
    last_look: int,
    rules: DecisionRules,
    breach_looks: int = 0,
    drift: DriftGuard | None = None,
    at_look: int | None = None,
) -> Verdict:
    """Blue/green's verdict: ``decide`` against stable's snapshot, and at the watch window's last look a hold becomes
    keep (promote) or, with a guardrail still broken or the drift guard against it, switch back (rollback)."""
    v = decide(candidate, baseline, dwell_seconds, last_look, rules, breach_looks, at_look)
    end = watch_last_look(baseline, rules)
    if not v.evaluated or v.action != "hold" or v.look < end:
        return v
    if v.breaches:
        return replace(
            v, action="rollback", reason=f"guardrail broken at the end of the watch window (look {v.look}): {v.reason}"
        )
    blocked = drift_block(v, drift, rules)
    if blocked is not None:
        return replace(v, action="rollback", reason=f"end of the watch window (look {v.look}): {blocked}")
    return replace(
        v,
        action="promote",
        kept=True,
        reason=f"kept: no live regression by the end of the watch window (look {v.look}, {v.samples} shown "
        f"against stable's snapshot): {v.reason}",
    )
