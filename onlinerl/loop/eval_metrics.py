"""Offline evaluation figures for one policy version over a held-out split (pure)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass

from onlinerl.loop.user_model import AcceptRule, decide, edit_similarity


@dataclass(frozen=True)
class EvalRecord:
    sample_id: str
    middle: str
    shown: str
    failed: bool = False
    version: int = 0
    raw: str = ""  # the completion as served, before Continue's display filters


@dataclass(frozen=True)
class EvalSummary:
    requests: int
    failed: int
    shown: int
    accepted: int
    accept_rate: float  # accepted / shown
    suggestion_rate: float  # shown (non-empty) / requests
    accepted_per_100: float  # accepted per 100 requests
    exact_match: float
    edit_similarity: float
    mean_length: float  # chars of shown suggestions

    def as_dict(self) -> dict:
        return asdict(self)


def summarize(records: Iterable[EvalRecord], rule: AcceptRule = AcceptRule()) -> EvalSummary:
    recs = list(records)
    ok = [r for r in recs if not r.failed]
    shown = [r for r in ok if r.shown.strip()]
    accepted = sum(decide(r.shown, r.middle, rule) for r in shown)
    n = len(recs)
    return EvalSummary(
        requests=n,
        failed=n - len(ok),
        shown=len(shown),
        accepted=accepted,
        accept_rate=accepted / len(shown) if shown else 0.0,
        suggestion_rate=len(shown) / n if n else 0.0,
        accepted_per_100=100.0 * accepted / n if n else 0.0,
        exact_match=sum(r.shown.strip() == r.middle.strip() for r in ok) / len(ok) if ok else 0.0,
        edit_similarity=sum(edit_similarity(r.shown.strip(), r.middle.strip()) for r in ok) / len(ok) if ok else 0.0,
        mean_length=sum(len(r.shown) for r in shown) / len(shown) if shown else 0.0,
    )


def comparison_table(summaries: dict[str, EvalSummary]) -> str:
    """Markdown table, one column per version."""
    names = list(summaries)
    rows = [
        ("requests", "requests", "{:d}"),
        ("failed requests", "failed", "{:d}"),
        ("simulated accept rate", "accept_rate", "{:.3f}"),
        ("suggestion rate", "suggestion_rate", "{:.3f}"),
        ("accepted / 100 requests", "accepted_per_100", "{:.1f}"),
        ("exact match", "exact_match", "{:.3f}"),
        ("edit similarity", "edit_similarity", "{:.3f}"),
        ("mean length (chars)", "mean_length", "{:.1f}"),
    ]
    out = ["| metric | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for label, attr, fmt in rows:
        out.append(f"| {label} | " + " | ".join(fmt.format(getattr(summaries[n], attr)) for n in names) + " |")
    return "\n".join(out)
