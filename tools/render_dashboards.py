"""Draw each Grafana dashboard's layout (panel boxes, titles, types, queried metrics) as a PNG from its JSON.

Why: a chart user should see what the dashboards hold before installing Grafana. The picture is computed from the
very JSON the chart ships (gridPos is Grafana's 24-column grid, one row unit = 30 px), so it cannot drift.
Usage: .venv/bin/python tools/render_dashboards.py [DASHBOARD_DIR] [OUT_DIR]
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import textwrap
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import FancyBboxPatch

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DASHBOARDS = ROOT / "charts" / "onlinerl" / "dashboards"
DEFAULT_OUT = ROOT / "charts" / "onlinerl" / "docs"
METRIC = re.compile(r"\b(onlinerl_[a-z0-9_]+|vllm:[a-z0-9_:]+)")
HISTOGRAM_SUFFIX = re.compile(r"_(bucket|sum|count)$")
COLOURS = {"timeseries": "#dbeafe", "stat": "#dcfce7", "gauge": "#fef9c3", "heatmap": "#ffedd5", "row": "#e5e7eb"}


def panel_metrics(panel: dict[str, Any]) -> list[str]:
    """Distinct metric names a panel queries, histogram suffixes folded, in first-use order."""
    seen: dict[str, None] = {}
    for target in panel.get("targets", []):
        for name in METRIC.findall(target.get("expr", "")):
            seen.setdefault(HISTOGRAM_SUFFIX.sub("", name), None)
    return list(seen)


def json_digest(text: str) -> str:
    """Stored in the PNG (tEXt "Source") so a test can tell that the picture was drawn from the current JSON."""
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def render(dashboard: dict[str, Any], out: Path, source_digest: str = "") -> Path:
    panels = dashboard["panels"]
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    fig_w = 16.0
    fig_h = max(4.0, rows * 0.3 + 1.0)
    fig, ax = plt.subplots(figsize=(fig_w, fig_h), dpi=110)
    ax.set_xlim(0, 24)
    ax.set_ylim(rows + 1.6, 0)
    ax.axis("off")
    ax.text(0, 0.9, dashboard["title"], fontsize=15, weight="bold", va="bottom")
    ax.text(24, 0.9, dashboard.get("description", ""), fontsize=8.5, ha="right", va="bottom", color="#4b5563")
    top = 1.2
    for p in panels:
        g = p["gridPos"]
        x, y, w, h = g["x"], g["y"] + top, g["w"], g["h"]
        kind = p["type"]
        ax.add_patch(
            FancyBboxPatch(
                (x + 0.08, y + 0.08),
                w - 0.16,
                h - 0.16,
                boxstyle="round,pad=0,rounding_size=0.15",
                facecolor=COLOURS.get(kind, "#f3f4f6"),
                edgecolor="#6b7280",
                linewidth=0.8,
            )
        )
        if kind == "row":
            ax.text(x + 0.3, y + h / 2 + 0.05, p["title"], fontsize=10, weight="bold", va="center")
            continue
        chars_per_line = max(8, int(w * 5.2))
        title = "\n".join(textwrap.wrap(p["title"], chars_per_line)[:2])
        ax.text(x + 0.3, y + 0.35, title, fontsize=9, weight="bold", va="top")
        ax.text(x + w - 0.3, y + h - 0.3, kind, fontsize=7.5, ha="right", va="bottom", color="#374151", style="italic")
        metrics = panel_metrics(p)
        room = max(0, int(h * 0.3 / 0.13 / 2.4) - 1)
        if len(metrics) > room:
            metrics = [*metrics[: max(room - 1, 0)], f"+{len(metrics) - room + 1} more"]
        shown = metrics
        width = int(w * 6.3)
        body = "\n".join(m if len(m) <= width else m[: width - 1] + "…" for m in shown)
        ax.text(
            x + 0.3,
            y + 0.45 + 0.55 * (title.count("\n") + 1),
            body,
            fontsize=7,
            va="top",
            family="monospace",
            color="#1f2937",
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, bbox_inches="tight", facecolor="white", metadata={"Source": source_digest})
    plt.close(fig)
    return out


def main(argv: list[str]) -> int:
    src = Path(argv[0]) if argv else DEFAULT_DASHBOARDS
    dst = Path(argv[1]) if len(argv) > 1 else DEFAULT_OUT
    for path in sorted(src.glob("*.json")):
        text = path.read_text()
        out = render(json.loads(text), dst / f"{path.stem}.png", json_digest(text))
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
