"""How often the canary decision is right, and how many samples it takes (bench, not a test).

Simulates per-arm Bernoulli accept outcomes at known rates (numpy, seeded), lets the smaller arm grow to
``--max-samples`` and calls ``decide`` at every group-sequential look. Prints, per candidate rate, the share of runs
that promote / roll back / hold and the median samples per arm at the decision.

    .venv/bin/python bench/rollout_decisions.py --runs 400
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import numpy as np

from onlinerl.rollout.records import ArmStats
from onlinerl_rollout.decision import DecisionRules, decide


def run_once(
    rng: np.random.Generator, p_candidate: float, p_stable: float, rules: DecisionRules, max_samples: int
) -> tuple[str, int]:
    """One canary: counters grow look by look (the decision only reads at looks, so finer steps change nothing)."""
    n_prev, acc_c, acc_s, last = 0, 0, 0, -1
    n = rules.min_samples
    while n <= max_samples:
        acc_c += int(rng.binomial(n - n_prev, p_candidate))
        acc_s += int(rng.binomial(n - n_prev, p_stable))
        v = decide(ArmStats(n, acc_c, served=n), ArmStats(n, acc_s, served=n), 1e12, last, rules)
        last = v.look if v.evaluated else last
        if v.action != "hold":
            return v.action, n
        n_prev, n = n, n * 2
    return "hold", max_samples


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=400)
    ap.add_argument("--stable", type=float, default=0.30)
    ap.add_argument("--candidates", type=float, nargs="+", default=[0.24, 0.27, 0.29, 0.30, 0.31, 0.33, 0.36])
    ap.add_argument("--min-samples", type=int, default=200)
    ap.add_argument("--max-samples", type=int, default=25600)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rules = DecisionRules(min_samples=args.min_samples, min_dwell_seconds=0)
    rng = np.random.default_rng(args.seed)
    print(f"stable {args.stable}, {args.runs} runs each, looks at {args.min_samples}*2^k up to {args.max_samples}")
    print("| candidate | promote | rollback | hold | median samples/arm at decision |")
    print("|---|---|---|---|---|")
    for pc in args.candidates:
        results = [run_once(rng, pc, args.stable, rules, args.max_samples) for _ in range(args.runs)]
        counts = collections.Counter(a for a, _ in results)
        decided = [n for a, n in results if a != "hold"]
        med = int(statistics.median(decided)) if decided else "-"
        print(
            f"| {pc:.2f} | {counts['promote'] / args.runs:.1%} | {counts['rollback'] / args.runs:.1%} "
            f"| {counts['hold'] / args.runs:.1%} | {med} |"
        )

    print()
    print("| shown per arm | decide() time (median of 20) |")
    print("|---|---|")
    for n in (200, 3200, 25600, 204800):
        a, b = ArmStats(n, int(n * 0.3), served=n), ArmStats(n, int(n * 0.31), served=n)
        times = []
        for _ in range(20):
            t0 = time.perf_counter()
            decide(b, a, 1e12, -1, rules)
            times.append(time.perf_counter() - t0)
        print(f"| {n} | {statistics.median(times) * 1e3:.2f} ms |")


if __name__ == "__main__":
    main()
