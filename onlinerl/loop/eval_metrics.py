"""Offline evaluation figures for policy versions over a held-out split, and paired comparisons between them (pure).

Accept rate alone can be gamed by brevity: a policy that shows one safe token is accepted more often and writes less
code. So every version also gets the figures a shorter policy cannot inflate: accepted characters per 100 requests,
mean accepted and shown length, the suggestion rate, and the share of accepts that complete the whole middle (the
simulated user knows the true middle). The share of suggestions shown as a multi-line block says which way a policy
went on the one choice teams differ on, to stop after the first line or to go on (user_model.py's habits).

Versions run on the same samples, so comparisons are *paired*: McNemar's exact test on "accepted on this sample", a
sign test on accepted characters per sample, and a paired percentile bootstrap confidence interval for the difference
in every figure.

All figures derive from per-sample :class:`Outcome` counts through :func:`figures`, so the summary and every
bootstrap resample compute a figure the same way.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

from onlinerl.loop.user_model import AcceptRule, decide, edit_similarity

BOOTSTRAP_RESAMPLES = 2000
CONFIDENCE = 0.95


@dataclass(frozen=True)
class EvalRecord:
    sample_id: str
    middle: str
    shown: str
    failed: bool = False
    version: int = 0
    raw: str = ""  # the completion as served, before Continue's display filters


_RECORD_FIELDS = {"sample_id": str, "middle": str, "shown": str, "failed": bool, "version": int, "raw": str}
_RECORD_REQUIRED = ("sample_id", "middle", "shown")


def record_from_dict(obj: object) -> EvalRecord:
    """An :class:`EvalRecord` from a ``v<N>.jsonl`` line, or ValueError naming the field that is wrong."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - set(_RECORD_FIELDS))
    missing = [k for k in _RECORD_REQUIRED if k not in obj]
    if unknown or missing:
        raise ValueError(f"missing fields {missing}, unknown fields {unknown}")
    for name, value in obj.items():
        kind = _RECORD_FIELDS[name]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ValueError(f"field {name!r} must be {kind.__name__}, got {type(value).__name__}")
    return EvalRecord(**obj)


@dataclass(frozen=True)
class Outcome:
    """What one request gave the simulated user. A failed request shows nothing (it still counts as a request)."""

    sample_id: str
    shown_chars: int  # 0: nothing shown
    accepted: bool
    whole_middle: bool  # accepted, and the shown text is the entire true middle
    multi_line: bool = False  # shown as a block of more than one line


def _norm(text: str) -> str:
    """Trailing whitespace per line and around the text does not change what the user gets."""
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


def outcome(record: EvalRecord, rule: AcceptRule = AcceptRule()) -> Outcome:
    shown = "" if record.failed else record.shown.strip()
    accepted = bool(shown) and decide(shown, record.middle, rule)
    whole = accepted and _norm(shown) == _norm(record.middle)
    return Outcome(record.sample_id, len(shown), accepted, whole, "\n" in shown)


@dataclass(frozen=True)
class Totals:
    """Counts over a set of requests; every figure is a ratio of two of them."""

    requests: int = 0
    shown: int = 0
    accepted: int = 0
    accepted_chars: int = 0
    shown_chars: int = 0
    whole_middle: int = 0
    multi_line: int = 0


def totals(outcomes: Iterable[Outcome]) -> Totals:
    n = s = a = ac = sc = w = m = 0
    for o in outcomes:
        n += 1
        if o.shown_chars:
            s += 1
            sc += o.shown_chars
            m += o.multi_line
        if o.accepted:
            a += 1
            ac += o.shown_chars
            w += o.whole_middle
    return Totals(n, s, a, ac, sc, w, m)


def _ratio(num: float, den: float) -> float:
    return num / den if den else 0.0


# name -> (label, format): the figures reported per version and compared between versions, in table order.
FIGURES: dict[str, tuple[str, str]] = {
    "accept_rate": ("simulated accept rate", "{:.3f}"),
    "accepted_per_100": ("accepted / 100 requests", "{:.1f}"),
    "accepted_chars_per_100": ("accepted chars / 100 requests", "{:.0f}"),
    "mean_accepted_length": ("mean accepted length (chars)", "{:.1f}"),
    "mean_shown_length": ("mean shown length (chars)", "{:.1f}"),
    "suggestion_rate": ("suggestion rate", "{:.3f}"),
    "multi_line_share": ("shown as a multi-line block", "{:.3f}"),
    "whole_middle_share": ("accepts completing the whole middle", "{:.3f}"),
}


def figures(t: Totals) -> dict[str, float]:
    """The :data:`FIGURES` of a set of requests (0.0 where the denominator is empty)."""
    return {
        "accept_rate": _ratio(t.accepted, t.shown),  # accepted / shown
        "accepted_per_100": 100.0 * _ratio(t.accepted, t.requests),
        "accepted_chars_per_100": 100.0 * _ratio(t.accepted_chars, t.requests),
        "mean_accepted_length": _ratio(t.accepted_chars, t.accepted),
        "mean_shown_length": _ratio(t.shown_chars, t.shown),
        "suggestion_rate": _ratio(t.shown, t.requests),  # shown (non-empty) / requests
        "multi_line_share": _ratio(t.multi_line, t.shown),  # multi-line / shown
        "whole_middle_share": _ratio(t.whole_middle, t.accepted),
    }


@dataclass(frozen=True)
class EvalSummary:
    requests: int
    failed: int
    shown: int
    accepted: int
    accept_rate: float
    suggestion_rate: float
    accepted_per_100: float
    accepted_chars_per_100: float
    mean_accepted_length: float
    mean_shown_length: float
    multi_line_share: float
    whole_middle_share: float
    exact_match: float
    edit_similarity: float

    def as_dict(self) -> dict:
        return asdict(self)


def summarize(records: Iterable[EvalRecord], rule: AcceptRule = AcceptRule()) -> EvalSummary:
    recs = list(records)
    ok = [r for r in recs if not r.failed]
    t = totals(outcome(r, rule) for r in recs)
    return EvalSummary(
        requests=t.requests,
        failed=len(recs) - len(ok),
        shown=t.shown,
        accepted=t.accepted,
        **figures(t),
        exact_match=sum(r.shown.strip() == r.middle.strip() for r in ok) / len(ok) if ok else 0.0,
        edit_similarity=sum(edit_similarity(r.shown.strip(), r.middle.strip()) for r in ok) / len(ok) if ok else 0.0,
    )


# --- paired statistics ----------------------------------------------------------------------------------------------


def binomial_two_sided_p(k: int, n: int) -> float:
    """Exact two-sided p of ``k`` successes in ``n`` fair coin flips (doubled smaller tail, at most 1)."""
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(k, n - k) + 1))
    return min(1.0, 2 * tail / 2**n)


@dataclass(frozen=True)
class McNemar:
    """Paired binary outcome: which samples only one version got accepted."""

    only_base: int
    only_candidate: int
    both: int
    neither: int
    chi2: float  # (b - c)^2 / (b + c), no continuity correction
    p_chi2: float  # its asymptotic p (1 degree of freedom)
    p_exact: float  # exact conditional (binomial) p: the one to trust when b + c is small

    @property
    def pairs(self) -> int:
        return self.only_base + self.only_candidate + self.both + self.neither

    def diff_ci(self, confidence: float = CONFIDENCE) -> tuple[float, float]:
        """Wald interval for the paired difference in proportions (candidate - base), per request."""
        n, b, c = self.pairs, self.only_base, self.only_candidate
        if n == 0:
            return (0.0, 0.0)
        d = (c - b) / n
        se = math.sqrt(max(0.0, (b + c) - (c - b) ** 2 / n)) / n
        z = _z(confidence)
        return (d - z * se, d + z * se)


def mcnemar(base: Sequence[bool], candidate: Sequence[bool]) -> McNemar:
    if len(base) != len(candidate):
        raise ValueError("mcnemar needs paired outcomes of equal length")
    b = sum(x and not y for x, y in zip(base, candidate, strict=True))
    c = sum(y and not x for x, y in zip(base, candidate, strict=True))
    both = sum(x and y for x, y in zip(base, candidate, strict=True))
    chi2 = (b - c) ** 2 / (b + c) if b + c else 0.0
    return McNemar(
        b, c, both, len(base) - b - c - both, chi2, math.erfc(math.sqrt(chi2 / 2)), binomial_two_sided_p(b, b + c)
    )


@dataclass(frozen=True)
class SignTest:
    """Per pair: did the candidate get more, fewer or the same (ties are dropped, as the sign test does)."""

    better: int
    worse: int
    ties: int
    p_value: float


def sign_test(base: Sequence[float], candidate: Sequence[float]) -> SignTest:
    if len(base) != len(candidate):
        raise ValueError("sign_test needs paired values of equal length")
    better = sum(y > x for x, y in zip(base, candidate, strict=True))
    worse = sum(y < x for x, y in zip(base, candidate, strict=True))
    return SignTest(better, worse, len(base) - better - worse, binomial_two_sided_p(better, better + worse))


def _z(confidence: float) -> float:
    """Two-sided standard normal quantile (bisection on erfc: no scipy in the base install)."""
    target = 1.0 - confidence
    lo, hi = 0.0, 40.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if math.erfc(mid / math.sqrt(2)) > target else (lo, mid)
    return (lo + hi) / 2


def _percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    pos = q * (len(sorted_values) - 1)
    i = math.floor(pos)
    j = min(i + 1, len(sorted_values) - 1)
    return sorted_values[i] + (sorted_values[j] - sorted_values[i]) * (pos - i)


def paired_bootstrap(
    pairs: Sequence[tuple[Outcome, Outcome]],
    resamples: int = BOOTSTRAP_RESAMPLES,
    confidence: float = CONFIDENCE,
    seed: int = 0,
) -> dict[str, tuple[float, float]]:
    """Percentile interval of (candidate - base) for every figure, resampling *samples* (both versions together).

    Resampling the pair keeps the correlation between the versions on one sample, which is what makes a paired
    interval narrower than two independent ones. Seeded, so a report is reproducible.
    """
    if not pairs:
        return {name: (0.0, 0.0) for name in FIGURES}
    rng = random.Random(seed)
    n = len(pairs)
    diffs: dict[str, list[float]] = {name: [] for name in FIGURES}
    for _ in range(resamples):
        idx = [rng.randrange(n) for _ in range(n)]
        fa = figures(totals(pairs[i][0] for i in idx))
        fb = figures(totals(pairs[i][1] for i in idx))
        for name in FIGURES:
            diffs[name].append(fb[name] - fa[name])
    alpha = (1.0 - confidence) / 2
    out = {}
    for name, values in diffs.items():
        values.sort()
        out[name] = (_percentile(values, alpha), _percentile(values, 1.0 - alpha))
    return out


def pair_outcomes(base: Iterable[Outcome], candidate: Iterable[Outcome]) -> list[tuple[Outcome, Outcome]]:
    """Pairs on the same sample, in sample order; a sample only one version has is left out (never mis-paired)."""
    by_id = {o.sample_id: o for o in candidate}
    return [(o, by_id[o.sample_id]) for o in sorted(base, key=lambda o: o.sample_id) if o.sample_id in by_id]


@dataclass(frozen=True)
class FigureDiff:
    name: str
    base: float
    candidate: float
    ci_low: float
    ci_high: float

    @property
    def diff(self) -> float:
        return self.candidate - self.base

    @property
    def significant(self) -> bool:
        """The interval excludes zero."""
        return self.ci_low > 0 or self.ci_high < 0


@dataclass(frozen=True)
class Comparison:
    base: str
    candidate: str
    pairs: int
    figures: list[FigureDiff]
    accepted: McNemar
    accepted_chars: SignTest
    confidence: float = CONFIDENCE
    resamples: int = BOOTSTRAP_RESAMPLES

    def as_dict(self) -> dict:
        return {
            "base": self.base,
            "candidate": self.candidate,
            "pairs": self.pairs,
            "confidence": self.confidence,
            "bootstrap_resamples": self.resamples,
            "figures": {
                f.name: {"base": f.base, "candidate": f.candidate, "diff": f.diff, "ci": [f.ci_low, f.ci_high]}
                for f in self.figures
            },
            "mcnemar_accepted": asdict(self.accepted) | {"accepted_per_request_diff_ci": list(self.accepted.diff_ci())},
            "sign_test_accepted_chars": asdict(self.accepted_chars),
        }


def compare(
    base_name: str,
    base: Iterable[Outcome],
    candidate_name: str,
    candidate: Iterable[Outcome],
    resamples: int = BOOTSTRAP_RESAMPLES,
    confidence: float = CONFIDENCE,
    seed: int = 0,
) -> Comparison:
    """Every figure of ``candidate`` against ``base`` on the samples both answered, with intervals and tests."""
    pairs = pair_outcomes(base, candidate)
    fa = figures(totals(a for a, _ in pairs))
    fb = figures(totals(b for _, b in pairs))
    ci = paired_bootstrap(pairs, resamples, confidence, seed)
    diffs = [FigureDiff(name, fa[name], fb[name], *ci[name]) for name in FIGURES]
    chars = [(a.shown_chars if a.accepted else 0, b.shown_chars if b.accepted else 0) for a, b in pairs]
    return Comparison(
        base_name,
        candidate_name,
        len(pairs),
        diffs,
        mcnemar([a.accepted for a, _ in pairs], [b.accepted for _, b in pairs]),
        sign_test([x for x, _ in chars], [y for _, y in chars]),
        confidence,
        resamples,
    )


# --- rendering ------------------------------------------------------------------------------------------------------


def comparison_table(summaries: dict[str, EvalSummary]) -> str:
    """Markdown table, one column per version."""
    names = list(summaries)
    rows = [("requests", "requests", "{:d}"), ("failed requests", "failed", "{:d}")]
    rows += [(label, name, fmt) for name, (label, fmt) in FIGURES.items()]
    rows += [("exact match", "exact_match", "{:.3f}"), ("edit similarity", "edit_similarity", "{:.3f}")]
    out = ["| metric | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for label, attr, fmt in rows:
        out.append(f"| {label} | " + " | ".join(fmt.format(getattr(summaries[n], attr)) for n in names) + " |")
    return "\n".join(out)


def _signed(fmt: str, value: float) -> str:
    text = fmt.format(value)
    return text if text.startswith("-") else "+" + text


def _p(p: float) -> str:
    return "< 0.001" if p < 0.001 else f"{p:.3f}"


def paired_table(c: Comparison) -> str:
    """Markdown for one comparison: each figure's difference with its interval, then the two paired tests."""
    pct = f"{100 * c.confidence:g}%"
    out = [
        f"**{c.candidate} vs {c.base}**, paired on {c.pairs} samples ({pct} paired bootstrap, {c.resamples} resamples)",
        "",
        f"| metric | {c.base} | {c.candidate} | change | {pct} CI of the change |",
        "|---|---|---|---|---|",
    ]
    for f in c.figures:
        label, fmt = FIGURES[f.name]
        mark = " *" if f.significant else ""
        out.append(
            f"| {label} | {fmt.format(f.base)} | {fmt.format(f.candidate)} | {_signed(fmt, f.diff)}{mark} | "
            f"[{_signed(fmt, f.ci_low)}, {_signed(fmt, f.ci_high)}] |"
        )
    m, s = c.accepted, c.accepted_chars
    lo, hi = m.diff_ci(c.confidence)
    out += [
        "",
        "\\* the interval excludes 0.",
        "",
        f"- Accepted on the same sample (McNemar): {m.only_candidate} only by {c.candidate}, {m.only_base} only by "
        f"{c.base}, {m.both} by both; χ² = {m.chi2:.2f}, exact p = {_p(m.p_exact)}; accepted per 100 requests "
        f"{_signed('{:.1f}', 100 * (lo + hi) / 2)}, {pct} CI [{_signed('{:.1f}', 100 * lo)}, "
        f"{_signed('{:.1f}', 100 * hi)}].",
        f"- Accepted characters per sample (sign test): more from {c.candidate} on {s.better}, fewer on {s.worse}, "
        f"the same on {s.ties}; p = {_p(s.p_value)}.",
    ]
    return "\n".join(out)
