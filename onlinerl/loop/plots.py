"""PNG plots of a simulate timeline: accept rate against feedback events, with policy-version change marks."""

from __future__ import annotations

from pathlib import Path

import orjson


def read_timeline(path: Path) -> list[dict]:
    with open(path, "rb") as f:
        rows = [orjson.loads(line) for line in f if line.strip()]
    return sorted((r for r in rows if r.get("shown") is not None), key=lambda r: r["t"])


def rolling_accept_rate(rows: list[dict], window: int = 100) -> tuple[list[int], list[float]]:
    """(event index, accept rate over the last ``window`` shown suggestions)."""
    xs, ys, acc, shown = [], [], [], []
    for i, r in enumerate(rows, 1):
        if r["shown"]:
            shown.append(1)
            acc.append(1 if r["accepted"] else 0)
        shown, acc = shown[-window:], acc[-window:]
        if shown:
            xs.append(i)
            ys.append(sum(acc) / len(shown))
    return xs, ys


def version_changes(rows: list[dict]) -> list[tuple[int, int]]:
    """(event index, new version) each time the served version increases."""
    out, current = [], None
    for i, r in enumerate(rows, 1):
        v = r.get("version")
        if v is not None and (current is None or v > current):
            if current is not None:
                out.append((i, v))
            current = v
    return out


def plot_accept_rate(timeline: Path, out_png: Path, window: int = 100, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_timeline(timeline)
    xs, ys = rolling_accept_rate(rows, window)
    fig, ax = plt.subplots(figsize=(9, 4.5), dpi=110)
    ax.plot(xs, ys, color="#1f77b4", lw=1.6, label=f"accept rate (last {window} shown)")
    for x, v in version_changes(rows):
        ax.axvline(x, color="#d62728", alpha=0.35, lw=0.8)
        ax.text(
            x,
            1.01,
            f"v{v}",
            rotation=90,
            fontsize=7,
            color="#d62728",
            va="bottom",
            ha="center",
            transform=ax.get_xaxis_transform(),
        )
    ax.set_xlabel("feedback events")
    ax.set_ylabel("simulated accept rate")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    if title:
        ax.set_title(title, pad=24)
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png)
    plt.close(fig)
    return out_png


def plot_comparison(comparison, out_png: Path) -> Path:
    """Each figure's change from the base version, in percent of the base, with its paired confidence interval.

    One picture answers "better or only shorter": accept rate and accepted characters side by side, each with the
    uncertainty the paired test gives it. ``comparison`` is an :class:`onlinerl.loop.eval_metrics.Comparison`.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from onlinerl.loop.eval_metrics import FIGURES

    rows = [f for f in comparison.figures if f.base]  # a change relative to 0 has no percent
    labels = [FIGURES[f.name][0] for f in rows]
    change = [100.0 * f.diff / f.base for f in rows]
    low = [100.0 * (f.diff - f.ci_low) / abs(f.base) for f in rows]
    high = [100.0 * (f.ci_high - f.diff) / abs(f.base) for f in rows]
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(rows) + 1.5), dpi=110)
    ys = list(range(len(rows)))[::-1]
    colors = ["#2ca02c" if c >= 0 else "#d62728" for c in change]
    ax.barh(ys, change, color=colors, alpha=0.6, xerr=[low, high], capsize=3)
    ax.set_yticks(ys, labels, fontsize=8)
    ax.axvline(0, color="black", lw=0.8)
    pct = f"{100 * comparison.confidence:g}%"
    ax.set_xlabel(f"change vs {comparison.base} (% of {comparison.base}), {pct} paired bootstrap interval")
    ax.set_title(f"{comparison.candidate} vs {comparison.base} on {comparison.pairs} paired samples", fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png)
    plt.close(fig)
    return out_png
