"""The offline eval gate: a freshly loaded version becomes a candidate only if its eval figures are not worse than
stable's by more than the configured margins, and its outputs are not degenerate. Pure: records in, verdict out.

The eval run itself (held-out prompts through the serving path, a simulated user deciding accept) is ``onlinerl
eval``'s job; it hands the gate a :class:`GateInput`: for each version, one :class:`EvalRecord` per request.

Guardrails against reward hacking (a policy that only gets shorter or quieter must not pass): suggestion rate (shown /
requests), accepted characters per 100 requests and mean shown length, each against a floor relative to stable.

Degeneracy checks compare against fixed bars *and* against stable: a bar that the stable policy itself already
breaks (the base model degenerates on some prompts) would otherwise block every candidate, including the ones that
repair it. So a check fails when the candidate is over its bar and worse than stable.

The figures that compare rates with stable's (accept rate, accepted per 100 requests, suggestion rate, accepted
characters) fail only when the shortfall is credible: the point figure is past its bar *and* the Beta posterior
probability that the candidate's rate is below stable's (times the floor) is at least ``confidence``. At 64 records
and ~7 accepts a version that loses 2 of them is within noise (P ~ 0.7), yet it was past the 0.02 / 2.0 margins:
in run 11 (docs/demo.md) two of three gates failed that way, each costing ~8 minutes of a 2-core machine and
holding every user on the base model. A candidate that is truly worse at the gate's size still fails (10 vs 20
accepts of 60: P = 0.98), and the live canary, with its own sequential test, is where promotion is earned.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from onlinerl.config import GateConfig
from onlinerl_rollout.decision import accepted_length_ratio, prob_below

NGRAM = 4
_TOKEN = re.compile(r"\w+|[^\w\s]")


@dataclass(frozen=True)
class EvalRecord:
    """One eval request: the text the simulated user was shown ('' = the policy stayed silent) and the verdict."""

    shown_text: str
    accepted: bool


@dataclass(frozen=True)
class GateInput:
    candidate_version: int
    stable_version: int
    candidate: Sequence[EvalRecord]
    stable: Sequence[EvalRecord]

    @classmethod
    def from_records(
        cls, candidate_version: int, stable_version: int, records: Iterable[Mapping[str, Any]]
    ) -> GateInput:
        """From eval records (``version``/``policy_version``, ``shown_text``/``completion``, ``accepted``)."""
        by_version: dict[int, list[EvalRecord]] = {candidate_version: [], stable_version: []}
        for rec in records:
            version = int(rec.get("version", rec.get("policy_version", -1)))
            if version in by_version:
                text = rec.get("shown_text", rec.get("completion", "")) or ""
                by_version[version].append(EvalRecord(str(text), bool(rec.get("accepted", False))))
        return cls(
            candidate_version, stable_version, tuple(by_version[candidate_version]), tuple(by_version[stable_version])
        )


@dataclass(frozen=True)
class GateThresholds:
    accept_rate_margin: float = 0.02
    accepted_per_100_margin: float = 2.0
    max_empty_rate: float = 0.9
    max_repetition_rate: float = 0.5
    min_records: int = 64
    max_length_ratio: float = 4.0
    min_length_ratio: float = 0.25
    min_suggestion_rate_ratio: float = 0.8
    min_accepted_chars_ratio: float = 0.75
    confidence: float = 0.95

    @classmethod
    def from_config(cls, cfg: GateConfig, **overrides: float) -> GateThresholds:
        base = cls(
            cfg.accept_rate_margin,
            cfg.accepted_per_100_margin,
            cfg.max_empty_rate,
            cfg.max_repetition_rate,
            cfg.eval_samples,
            cfg.max_length_ratio,
            cfg.min_length_ratio,
            cfg.min_suggestion_rate_ratio,
            cfg.min_accepted_chars_ratio,
            cfg.confidence,
        )
        return cls(**{**asdict(base), **overrides})


@dataclass(frozen=True)
class EvalFigures:
    requests: int
    shown: int
    accepted: int
    accept_rate: float
    accepted_per_100: float
    empty_rate: float
    repetition_rate: float
    mean_length: float
    suggestion_rate: float = 0.0
    accepted_chars_per_100: float = 0.0


@dataclass(frozen=True)
class GateResult:
    passed: bool
    reasons: tuple[str, ...]
    candidate: EvalFigures
    stable: EvalFigures

    def figures(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "reasons": list(self.reasons),
            "candidate": asdict(self.candidate),
            "stable": asdict(self.stable),
        }


def repetition_score(text: str) -> float:
    """Share of a completion that repeats itself: duplicate 4-grams of word/punctuation tokens, or repeated lines.

    Normal code repeats a little (``self.a = a`` / ``self.b = b`` share few 4-grams); a looping policy repeats almost
    everything. The larger of the two views counts, so both "foo foo foo ..." and the same line N times are caught.
    """
    tokens = _TOKEN.findall(text)
    grams = [tuple(tokens[i : i + NGRAM]) for i in range(len(tokens) - NGRAM + 1)]
    ngram_dup = 1.0 - len(set(grams)) / len(grams) if len(grams) >= 2 * NGRAM else 0.0
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    line_dup = 1.0 - len(set(lines)) / len(lines) if len(lines) >= 3 else 0.0
    return max(ngram_dup, line_dup)


def eval_figures(records: Sequence[EvalRecord]) -> EvalFigures:
    shown = [r for r in records if r.shown_text.strip()]
    accepted = sum(1 for r in shown if r.accepted)
    accepted_chars = sum(len(r.shown_text) for r in shown if r.accepted)
    n = len(records)
    return EvalFigures(
        requests=n,
        shown=len(shown),
        accepted=accepted,
        accept_rate=accepted / len(shown) if shown else 0.0,
        accepted_per_100=100.0 * accepted / n if n else 0.0,
        empty_rate=1.0 - len(shown) / n if n else 1.0,
        repetition_rate=sum(repetition_score(r.shown_text) for r in shown) / len(shown) if shown else 0.0,
        mean_length=sum(len(r.shown_text) for r in shown) / len(shown) if shown else 0.0,
        suggestion_rate=len(shown) / n if n else 0.0,
        accepted_chars_per_100=100.0 * accepted_chars / n if n else 0.0,
    )


def evaluate_gate(inp: GateInput, th: GateThresholds) -> GateResult:
    """Pass only if every check passes; each failed check adds one reason naming its figure and its bar."""
    cand, stab = eval_figures(inp.candidate), eval_figures(inp.stable)
    reasons: list[str] = []
    for name, fig in (("candidate", cand), ("stable", stab)):
        if fig.requests < th.min_records:
            reasons.append(
                f"{name} eval has {fig.requests} records, the gate needs {th.min_records} (gate.evalSamples)"
            )
    credible = _Credible(cand, stab, th.confidence)
    if cand.accept_rate < stab.accept_rate - th.accept_rate_margin and credible.below("accepted", "shown", 1.0):
        reasons.append(
            f"accept rate {cand.accept_rate:.3f} < stable {stab.accept_rate:.3f} - margin {th.accept_rate_margin}"
            f"{credible.said()}"
        )
    if cand.accepted_per_100 < stab.accepted_per_100 - th.accepted_per_100_margin and credible.below(
        "accepted", "requests", 1.0
    ):
        reasons.append(
            f"accepted per 100 requests {cand.accepted_per_100:.2f} < stable {stab.accepted_per_100:.2f} "
            f"- margin {th.accepted_per_100_margin}{credible.said()}"
        )
    if cand.suggestion_rate < th.min_suggestion_rate_ratio * stab.suggestion_rate and credible.below(
        "shown", "requests", th.min_suggestion_rate_ratio
    ):
        reasons.append(
            f"guardrail: suggestion rate {cand.suggestion_rate:.3f} < {th.min_suggestion_rate_ratio} x stable "
            f"{stab.suggestion_rate:.3f}{credible.said()}"
        )
    if cand.accepted_chars_per_100 < th.min_accepted_chars_ratio * stab.accepted_chars_per_100 and credible.below(
        "accepted", "requests", th.min_accepted_chars_ratio * _lengths(cand, stab)
    ):
        reasons.append(
            f"guardrail: accepted chars per 100 requests {cand.accepted_chars_per_100:.1f} < "
            f"{th.min_accepted_chars_ratio} x stable {stab.accepted_chars_per_100:.1f}{credible.said()}"
        )
    if cand.empty_rate > th.max_empty_rate and cand.empty_rate > stab.empty_rate:
        reasons.append(f"empty rate {cand.empty_rate:.3f} > max {th.max_empty_rate} (stable {stab.empty_rate:.3f})")
    if cand.repetition_rate > th.max_repetition_rate and cand.repetition_rate > stab.repetition_rate:
        reasons.append(
            f"repetition rate {cand.repetition_rate:.3f} > max {th.max_repetition_rate} "
            f"(stable {stab.repetition_rate:.3f})"
        )
    if stab.mean_length > 0 and cand.shown:
        ratio = cand.mean_length / stab.mean_length
        if ratio > th.max_length_ratio:
            reasons.append(
                f"guardrail: mean length {cand.mean_length:.0f} chars is {ratio:.1f}x stable's, "
                f"max {th.max_length_ratio}x"
            )
        if ratio < th.min_length_ratio:
            reasons.append(
                f"guardrail: mean length {cand.mean_length:.0f} chars is {ratio:.2f}x stable's, "
                f"min {th.min_length_ratio}x"
            )
    return GateResult(not reasons, tuple(reasons), cand, stab)


@dataclass
class _Credible:
    """Whether a candidate's rate is credibly below ``ratio`` x stable's: P(p_c < ratio p_s) >= ``confidence``
    (Beta(1, 1) posteriors of the two versions' counts; ``decision.prob_below``). Keeps the last probability for the
    failure's reason."""

    cand: EvalFigures
    stab: EvalFigures
    confidence: float
    last: float = 0.0

    def below(self, successes: str, trials: str, ratio: float) -> bool:
        c, s = self.cand, self.stab
        self.last = prob_below(
            getattr(c, successes), getattr(c, trials), ratio, getattr(s, successes), getattr(s, trials)
        )
        return self.last >= self.confidence

    def said(self) -> str:
        return f" (P = {self.last:.3f} >= {self.confidence})"


def _lengths(cand: EvalFigures, stab: EvalFigures) -> float:
    """``decision.accepted_length_ratio`` of the eval figures (per 100 requests on each side: the scale cancels); 1
    when either accepted nothing, so the yields alone are compared against the floor."""
    ratio = accepted_length_ratio(
        cand.accepted_per_100, cand.accepted_chars_per_100, stab.accepted_per_100, stab.accepted_chars_per_100
    )
    return 1.0 if ratio is None else ratio
