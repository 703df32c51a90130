"""Statistics of the latency benchmarks (bench/serving_latency.py, bench/replicas.py): percentiles, paired medians with
bootstrap intervals, and issue 40's bar read against them. Standard library only, so a test imports it directly."""

from __future__ import annotations

import random
import statistics


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def paired_median(a: list[float], b: list[float]) -> float:
    """Median of per-round differences: rounds are adjacent in time, so slow phases of the box cancel out."""
    return statistics.median(x - y for x, y in zip(a, b, strict=True))


def paired_median_ci(
    a: list[float], b: list[float], level: float = 0.95, resamples: int = 2000, seed: int = 0
) -> tuple[float, float, float]:
    """The paired median and its percentile-bootstrap interval (rounds resampled with replacement), seconds.

    Why: on the 2-core VM the engine's own noise (stream p95 1.3-1.6x its p50) moves a paired median of 200 rounds by
    about a millisecond from run to run. On 2026-12-06 its 95% intervals were 2-3 ms wide, wider than the gateway's
    1 ms bar, so a point figure under or over the bar said little. Seeded: the same figures give the same interval."""
    diffs = [x - y for x, y in zip(a, b, strict=True)]
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(diffs, k=len(diffs))) for _ in range(resamples))
    tail = (1.0 - level) / 2
    return statistics.median(diffs), medians[int(tail * resamples)], medians[int((1.0 - tail) * resamples) - 1]


def against_bar(low: float, high: float, bar: float) -> str:
    """``met`` when the whole interval is at or under ``bar``, ``missed`` when it is all over it, else ``open``."""
    return "met" if high <= bar else "missed" if low > bar else "open"


# issue 40's bar, p50: the gateway path over vLLM alone, and the gateway's own share over vLLM with the capture, ms
BARS = (("direct", 3.0), ("direct+cap", 1.0))


def bar_table(latency: dict) -> list[str]:
    """The gateway's figures against the bar with 95% bootstrap intervals (:func:`paired_median_ci`)."""
    rows = [
        "| replicas | gateway, paired median [95% interval] ms | non-stream total | stream total |",
        "|---|---|---|---|",
    ]
    for n, res in latency.items():
        if "gateway" not in res:
            continue
        for base, bar in BARS:
            if base not in res:
                continue
            cells = []
            for metric in ("total", "stream_total"):
                mid, low, high = paired_median_ci(res["gateway"][metric], res[base][metric])
                verdict = against_bar(low, high, bar / 1e3)
                cells.append(f"{mid * 1e3:+.2f} [{low * 1e3:+.2f}, {high * 1e3:+.2f}] {verdict}")
            rows.append(f"| {n} | over {base} (bar {bar:g}) | {' | '.join(cells)} |")
    return rows
