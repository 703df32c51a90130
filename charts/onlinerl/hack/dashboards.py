"""Generate the Grafana dashboards in ../dashboards/ from one readable description per dashboard.

Why a generator: four dashboards share a datasource variable, a namespace filter, annotations and a grid layout;
writing ~60 panels of Grafana JSON by hand drifts. The committed JSON is the product (the chart ships it with
.Files.Get); tests/chart/test_dashboards.py asserts that it equals this script's output, so edit here, then run
    .venv/bin/python charts/onlinerl/hack/dashboards.py
Metric names are the contract of docs/architecture.md ("Prometheus metrics") and vLLM's own names.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from onlinerl.arms import CANDIDATE, STABLE  # the one definition of arm names (run with the project venv)
from onlinerl.metric_lines import SHARED_LABEL  # the shared policy's `line` label value

OUT_DIR = Path(__file__).resolve().parent.parent / "dashboards"
GRID_WIDTH = 24
# Series carry the job's name as `onlinerl_dev_job` (the operator's monitors: targetLabels onlinerl.dev/job), so two
# OnlineRLJobs in one namespace stay apart: every query filters by the namespace and the `job` variable.
JOB_LABEL = "onlinerl_dev_job"
NS = f'namespace=~"$namespace", {JOB_LABEL}=~"$job"'
# Per policy line (issue 39): series of a figure that is per line carry `line` (`shared` or the project). A version
# counts on its line, so a panel about the shared policy's versions picks line="shared"; per-line panels filter by the
# `line` variable and group by it.
LINE = "~$line"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


def sel(metric: str, **labels: str) -> str:
    """``metric{namespace=~"$namespace", onlinerl_dev_job=~"$job", k="v"}``; a value starting with ``~`` becomes a
    regex match."""
    parts = [NS]
    for key, value in labels.items():
        parts.append(f'{key}=~"{value[1:]}"' if value.startswith("~") else f'{key}="{value}"')
    return f"{metric}{{{', '.join(parts)}}}"


def quantile(q: float, histogram: str, by: str = "", window: str = "$__rate_interval", **labels: str) -> str:
    group = f"le, {by}" if by else "le"
    return f"histogram_quantile({q}, sum by ({group}) (rate({sel(histogram + '_bucket', **labels)}[{window}])))"


@dataclass
class Panel:
    """One panel; ``width``/``height`` in grid units. Targets are ``(expr, legend)`` pairs."""

    title: str
    kind: str
    targets: list[tuple[str, str]]
    unit: str = "short"
    width: int = 12
    height: int = 8
    description: str = ""
    stacked: bool = False
    bars: bool = False
    stepped: bool = False
    min: float | None = None
    max: float | None = None
    decimals: int | None = None
    thresholds: list[tuple[float | None, str]] = field(default_factory=lambda: [(None, "green")])


@dataclass
class Row:
    title: str


def _target(ref: str, expr: str, legend: str, kind: str) -> dict[str, Any]:
    target: dict[str, Any] = {
        "datasource": DATASOURCE,
        "refId": ref,
        "expr": expr,
        "legendFormat": legend or "__auto",
        "range": True,
        "instant": False,
    }
    if kind == "heatmap":
        target["format"] = "heatmap"
        target["legendFormat"] = "{{le}}"
    return target


def _field_config(p: Panel) -> dict[str, Any]:
    defaults: dict[str, Any] = {
        "unit": p.unit,
        "color": {"mode": "palette-classic" if p.kind == "timeseries" else "thresholds"},
        "thresholds": {
            "mode": "absolute",
            "steps": [{"color": color, "value": value} for value, color in p.thresholds],
        },
    }
    if p.min is not None:
        defaults["min"] = p.min
    if p.max is not None:
        defaults["max"] = p.max
    if p.decimals is not None:
        defaults["decimals"] = p.decimals
    if p.kind == "timeseries":
        defaults["custom"] = {
            "drawStyle": "bars" if p.bars else "line",
            "lineInterpolation": "stepAfter" if p.stepped else "linear",
            "lineWidth": 2 if p.stepped else 1,
            "fillOpacity": 60 if p.bars else 10,
            "showPoints": "never",
            "spanNulls": True,
            "stacking": {"mode": "normal" if p.stacked else "none", "group": "A"},
        }
    return {"defaults": defaults, "overrides": []}


def _options(p: Panel) -> dict[str, Any]:
    if p.kind == "stat":
        return {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "value",
            "graphMode": "area",
            "justifyMode": "auto",
            "orientation": "auto",
            "textMode": "auto",
        }
    if p.kind == "gauge":
        return {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "showThresholdLabels": False,
            "showThresholdMarkers": True,
        }
    if p.kind == "heatmap":
        return {
            "calculate": False,
            "yAxis": {"axisPlacement": "left"},
            "color": {"mode": "scheme", "scheme": "Oranges"},
            "cellGap": 1,
            "tooltip": {"mode": "single", "yHistogram": True},
        }
    return {
        "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
        "tooltip": {"mode": "multi", "sort": "desc"},
    }


def layout(items: list[Panel | Row]) -> list[dict[str, Any]]:
    """Place panels left to right, wrapping at 24 columns; a Row starts a new line. Returns Grafana panel JSON."""
    panels: list[dict[str, Any]] = []
    x = y = line_height = 0
    for pid, item in enumerate(items, start=1):
        if isinstance(item, Row):
            y += line_height
            x, line_height = 0, 0
            panels.append(
                {
                    "type": "row",
                    "id": pid,
                    "title": item.title,
                    "collapsed": False,
                    "panels": [],
                    "gridPos": {"x": 0, "y": y, "w": GRID_WIDTH, "h": 1},
                }
            )
            y += 1
            continue
        if x + item.width > GRID_WIDTH:
            y += line_height
            x, line_height = 0, 0
        refs = "ABCDEFGHIJ"
        panels.append(
            {
                "type": item.kind,
                "id": pid,
                "title": item.title,
                "description": item.description,
                "datasource": DATASOURCE,
                "gridPos": {"x": x, "y": y, "w": item.width, "h": item.height},
                "targets": [_target(refs[i], e, leg, item.kind) for i, (e, leg) in enumerate(item.targets)],
                "fieldConfig": _field_config(item),
                "options": _options(item),
            }
        )
        x += item.width
        line_height = max(line_height, item.height)
    return panels


def _label_variable(name: str, label: str, query: str) -> dict[str, Any]:
    """A multi-value query variable over one label's values, "All" (any value) by default."""
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DATASOURCE,
        "query": {"query": query, "refId": name},
        "definition": query,
        "includeAll": True,
        "multi": True,
        "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "refresh": 2,
        "sort": 1,
        "hide": 0,
        "regex": "",
        "options": [],
    }


def _variables(namespace_metric: str, window: bool, line_metric: str = "") -> list[dict[str, Any]]:
    variables: list[dict[str, Any]] = [
        {
            "name": "datasource",
            "label": "Data source",
            "type": "datasource",
            "query": "prometheus",
            "current": {},
            "hide": 0,
            "refresh": 1,
            "regex": "",
            "options": [],
        },
        _label_variable("namespace", "Namespace", f"label_values({namespace_metric}, namespace)"),
        # The jobs of the chosen namespaces (Grafana resolves variables in order: namespace first).
        _label_variable(
            "job", "OnlineRLJob", f'label_values({namespace_metric}{{namespace=~"$namespace"}}, {JOB_LABEL})'
        ),
    ]
    if line_metric:  # the policy lines of the chosen jobs: `shared` and each project's own (issue 39)
        variables.append(
            _label_variable(
                "line",
                "Policy line",
                f'label_values({line_metric}{{namespace=~"$namespace", {JOB_LABEL}=~"$job"}}, line)',
            )
        )
    if window:
        options = ["5m", "15m", "1h", "6h"]
        variables.append(
            {
                "name": "window",
                "label": "Accept-rate window",
                "type": "custom",
                "query": ",".join(options),
                "current": {"selected": True, "text": "15m", "value": "15m"},
                "hide": 0,
                "options": [{"selected": o == "15m", "text": o, "value": o} for o in options],
            }
        )
    return variables


ANNOTATIONS = [
    {
        "name": "Annotations & Alerts",
        "builtIn": 1,
        "type": "dashboard",
        "enable": True,
        "hide": True,
        "iconColor": "rgba(0, 211, 255, 1)",
        "datasource": {"type": "grafana", "uid": "-- Grafana --"},
        "target": {"limit": 100, "matchAny": False, "tags": [], "type": "dashboard"},
    },
    {
        "name": "Policy reloads",
        "enable": True,
        "iconColor": "blue",
        "datasource": DATASOURCE,
        "expr": f"sum(increase({sel('onlinerl_reloader_reloads_total', result='success')}[2m])) > 0",
        "step": "1m",
        "titleFormat": "policy reloaded",
        "textFormat": "a new policy version was loaded",
    },
    {
        "name": "Reload failures",
        "enable": True,
        "iconColor": "red",
        "datasource": DATASOURCE,
        "expr": f"sum(increase({sel('onlinerl_reloader_reloads_total', result='failure')}[2m])) > 0",
        "step": "1m",
        "titleFormat": "reload failed",
        "textFormat": "the reloader could not load a version",
    },
    {
        "name": "Promote / rollback",
        "enable": True,
        "iconColor": "purple",
        "datasource": DATASOURCE,
        "expr": "sum by (decision) (increase("
        f"{sel('onlinerl_rollout_decisions_total', decision='~promote|rollback|pin')}[2m])) > 0",
        "step": "1m",
        "titleFormat": "{{decision}}",
        "textFormat": "rollout controller decision",
    },
]


def dashboard(
    uid: str,
    title: str,
    description: str,
    items: list[Panel | Row],
    namespace_metric: str,
    window: bool = False,
    line_metric: str = "",
) -> dict[str, Any]:
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["onlinerl"],
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "timepicker": {},
        "timezone": "browser",
        "annotations": {"list": ANNOTATIONS},
        "links": [
            {
                "title": "OnlineRL dashboards",
                "type": "dashboards",
                "tags": ["onlinerl"],
                "asDropdown": True,
                "includeVars": True,
                "keepTime": True,
            }
        ],
        "templating": {"list": _variables(namespace_metric, window, line_metric)},
        "panels": layout(items),
    }


# ---------------------------------------------------------------------------------------------------------------
# The four dashboards.
# ---------------------------------------------------------------------------------------------------------------

ACC, SHOWN = "onlinerl_feedback_accepted_total", "onlinerl_feedback_shown_total"
REQ = "onlinerl_serving_requests_total"


def _accept_rate(by: str, window: str = "$window", **labels: str) -> str:
    grouping = f" by ({by})" if by else ""
    return (
        f"sum{grouping} (rate({sel(ACC, **labels)}[{window}]))\n"
        f"/ sum{grouping} (rate({sel(SHOWN, **labels)}[{window}]))"
    )


def learning() -> dict[str, Any]:
    pct = [(None, "red"), (0.2, "orange"), (0.3, "green")]
    items: list[Panel | Row] = [
        Row("Is the policy getting better?"),
        Panel(
            "Accept rate · stable (window)",
            "stat",
            [(_accept_rate("", arm=STABLE), STABLE)],
            "percentunit",
            width=4,
            height=5,
            decimals=1,
            thresholds=pct,
        ),
        Panel(
            "Accept rate · candidate (window)",
            "stat",
            [(_accept_rate("", arm=CANDIDATE), CANDIDATE)],
            "percentunit",
            width=4,
            height=5,
            decimals=1,
            thresholds=pct,
        ),
        Panel(
            "Stable version",
            "stat",
            [(f"max({sel('onlinerl_serving_policy_version', role=STABLE, line=SHARED_LABEL)})", STABLE)],
            width=4,
            height=5,
            decimals=0,
        ),
        Panel(
            "Candidate version",
            "stat",
            [(f"max({sel('onlinerl_serving_policy_version', role=CANDIDATE, line=SHARED_LABEL)})", CANDIDATE)],
            width=4,
            height=5,
            decimals=0,
        ),
        Panel(
            "P(candidate better)",
            "gauge",
            [(f"max({sel('onlinerl_rollout_candidate_win_probability')})", "")],
            "percentunit",
            width=4,
            height=5,
            min=0,
            max=1,
            decimals=0,
            thresholds=[(None, "red"), (0.05, "orange"), (0.95, "green")],
        ),
        Panel(
            "Accepted per 100 requests (window)",
            "stat",
            [(f"100 * sum(rate({sel(ACC)}[$window])) / sum(rate({sel(REQ, code='200')}[$window]))", "")],
            width=4,
            height=5,
            decimals=1,
        ),
        Panel(
            "Accept rate by policy version and arm",
            "timeseries",
            [(_accept_rate("version, arm"), "v{{version}} {{arm}}")],
            "percentunit",
            width=24,
            height=9,
            min=0,
            max=1,
            description="accepted / shown suggestions per policy version and arm, over $window. "
            "The loop learns when newer versions sit above older ones.",
        ),
        Panel(
            "Suggestions per request by arm",
            "timeseries",
            [
                (
                    f"sum by (arm) (rate({sel(SHOWN)}[$window]))\n/ sum by (arm) (rate({sel(REQ, code='200')}[$window]))",
                    "{{arm}}",
                )
            ],
            "percentunit",
            min=0,
            description="Shown (non-empty) suggestions per served request: "
            "a policy that learns to stay silent lowers this.",
        ),
        Panel(
            "Accepted per 100 requests by arm",
            "timeseries",
            [
                (
                    f"100 * sum by (arm) (rate({sel(ACC)}[$window]))\n/ sum by (arm) (rate({sel(REQ, code='200')}"
                    "[$window]))",
                    "{{arm}}",
                )
            ],
            min=0,
            description="The product metric: accepts per 100 completion requests (silence is not free).",
        ),
        Row("Safe rollout"),
        Panel(
            "Controller accept rate (posterior input)",
            "timeseries",
            [(f"max by (version, arm) ({sel('onlinerl_rollout_accept_rate')})", "v{{version}} {{arm}}")],
            "percentunit",
            width=8,
            min=0,
            max=1,
        ),
        Panel(
            "P(candidate better than stable)",
            "timeseries",
            [(f"max({sel('onlinerl_rollout_candidate_win_probability')})", "P(win)")],
            "percentunit",
            width=8,
            min=0,
            max=1,
        ),
        Panel(
            "Rollout decisions",
            "timeseries",
            [
                (
                    f"sum by (decision) (increase({sel('onlinerl_rollout_decisions_total')}[$__rate_interval]))",
                    "{{decision}}",
                )
            ],
            width=8,
            bars=True,
            stacked=True,
            decimals=0,
        ),
        Panel(
            "Served completions by arm",
            "timeseries",
            [(f"sum by (arm) (rate({sel('onlinerl_serving_rollouts_recorded_total')}[$__rate_interval]))", "{{arm}}")],
            "reqps",
            width=12,
            stacked=True,
        ),
        Panel(
            "Feedback shown vs accepted by arm",
            "timeseries",
            [
                (f"sum by (arm) (rate({sel(SHOWN)}[$__rate_interval]))", "shown {{arm}}"),
                (f"sum by (arm) (rate({sel(ACC)}[$__rate_interval]))", "accepted {{arm}}"),
            ],
            "ops",
            width=12,
        ),
        Panel(
            "Live figures (canary, blue/green watch)",
            "timeseries",
            [
                (
                    f"max by (version, arm, figure) ({sel('onlinerl_rollout_live_figure')})",
                    "v{{version}} {{arm}} {{figure}}",
                )
            ],
            width=12,
            description="The figures the controller's live decision compares, guardrails included (accepted "
            "characters per 100 requests, suggestion rate, mean shown length, empty rate).",
        ),
        Panel(
            "Gate figures",
            "timeseries",
            [
                (
                    f"max by (version, arm, figure) ({sel('onlinerl_rollout_gate_figure')})",
                    "v{{version}} {{arm}} {{figure}}",
                )
            ],
            width=12,
            description="The eval gate's held-out figures of the candidate and of stable.",
        ),
        Panel(
            "Guardrail breaches and blue/green switch",
            "timeseries",
            [
                (f"max by (source) ({sel('onlinerl_rollout_guardrail_breaches')})", "breaches {{source}}"),
                (f"max({sel('onlinerl_rollout_candidate_has_all_traffic')})", "candidate has all traffic"),
            ],
            width=24,
            decimals=0,
            min=0,
        ),
        Panel(
            "Project policy lines (issue 39)",
            "timeseries",
            [
                (f"max({sel('onlinerl_rollout_project_lines')})", "project lines judged"),
                (f"max({sel('onlinerl_rollout_project_canaries')})", "lines with a candidate"),
                (
                    "sum by (decision) (increase("
                    f"{sel('onlinerl_rollout_project_decisions_total')}[$__rate_interval]))",
                    "{{decision}}",
                ),
            ],
            width=24,
            decimals=0,
            min=0,
            description="Each project with an adapter of its own is rolled out on its own line (its own gate, "
            "canary, rollback and hold); its figures are in `onlinerl status` and its line's decisions stream.",
        ),
        *_line_panels(),
    ]
    return dashboard(
        "onlinerl-learning",
        "OnlineRL · Learning",
        "Accept rate by policy version and arm, and the canary controller's view.",
        items,
        "onlinerl_feedback_shown_total",
        window=True,
        line_metric="onlinerl_serving_policy_version",
    )


REWARDS = "onlinerl_feedback_rewards_total"


def _signed_reward(sign: str, other: str) -> str:
    """One sign's reward rate per line, 0 where a line has none of it yet (so the difference exists)."""
    return (
        f"sum by (line) (rate({sel(REWARDS, sign=sign, line=LINE)}[$window])\n"
        f"  or 0 * rate({sel(REWARDS, sign=other, line=LINE)}[$window]))"
    )


def _line_panels() -> list[Panel | Row]:
    """Each policy line side by side (issue 39): what it serves, how its users accept it, its canary's share."""
    recorded = "onlinerl_serving_rollouts_recorded_total"
    return [
        Row("Policy lines (the shared policy and each project's own adapter)"),
        Panel(
            "Served version per line",
            "timeseries",
            [
                (
                    "max by (line, role) ("
                    f"{sel('onlinerl_serving_policy_version', role=f'~{STABLE}|{CANDIDATE}', line=LINE)}) >= 0",
                    "{{line}} {{role}}",
                )
            ],
            width=24,
            stepped=True,
            decimals=0,
            description="Each line's stable and candidate version as the gateway routes them (a version counts on "
            "its own line: acme's v3 is not the shared v3).",
        ),
        Panel(
            "Accept rate per line",
            "timeseries",
            [(_accept_rate("line", line=LINE), "{{line}}")],
            "percentunit",
            min=0,
            max=1,
            description="accepted / shown suggestions of each line's users over $window, all its versions and arms.",
        ),
        Panel(
            "Canary share per line",
            "timeseries",
            [
                (f"max by (line) ({sel('onlinerl_serving_canary_share', line=LINE)})", "{{line}} table"),
                (
                    f"sum by (line) (rate({sel(recorded, arm=CANDIDATE, line=LINE)}[$window]))\n"
                    f"/ sum by (line) (rate({sel(recorded, arm=f'~{STABLE}|{CANDIDATE}', line=LINE)}[$window]))",
                    "{{line}} served",
                ),
            ],
            "percentunit",
            min=0,
            max=1,
            description="The share each line's policy table gives its candidate, and the share of its served "
            "completions the candidate arm really had over $window.",
        ),
        Panel(
            "Canary verdict per line",
            "timeseries",
            [
                (f"max by (line) ({sel('onlinerl_rollout_line_win_probability', line=LINE)})", "{{line}} P(better)"),
                (
                    f"max by (line, arm) ({sel('onlinerl_rollout_line_accept_rate', line=LINE)})",
                    "{{line}} {{arm}} accept rate",
                ),
            ],
            "percentunit",
            width=24,
            min=0,
            max=1,
            description="What each line's own canary decides on: P(candidate better than what the line serves) and "
            "the two arms' accept rates (the rollout controller's; a line without a canary has no series).",
        ),
        Panel(
            "Feedback outcomes per line",
            "timeseries",
            [
                (
                    f"sum by (line, outcome) (rate({sel('onlinerl_feedback_line_events_total', line=LINE)}[$window]))",
                    "{{line}} {{outcome}}",
                ),
            ],
            "ops",
            description="Events that rated a rollout, by outcome, counted on the line that served the rollout.",
        ),
        Panel(
            "Mean reward per line",
            "timeseries",
            [
                (
                    f"({_signed_reward('positive', 'negative')}\n- {_signed_reward('negative', 'positive')})\n"
                    "/ sum by (line) (rate("
                    f"{sel('onlinerl_feedback_line_events_total', outcome='accepted_for_training', line=LINE)}"
                    "[$window]))",
                    "{{line}}",
                ),
            ],
            description="The mean reward of the samples each line sends to training over $window.",
        ),
    ]


def feedback() -> dict[str, Any]:
    items: list[Panel | Row] = [
        Row("Feedback intake"),
        Panel(
            "Events/s",
            "stat",
            [(f"sum(rate({sel('onlinerl_feedback_events_total')}[5m]))", "")],
            "ops",
            width=6,
            height=5,
        ),
        Panel(
            "Join miss ratio (5m)",
            "stat",
            [
                (
                    f"sum(rate({sel('onlinerl_feedback_join_misses_total')}[5m]))\n"
                    f"/ sum(rate({sel('onlinerl_feedback_events_total')}[5m]))",
                    "",
                )
            ],
            "percentunit",
            width=6,
            height=5,
            thresholds=[(None, "green"), (0.05, "orange"), (0.2, "red")],
        ),
        Panel(
            "Backlog (unconsumed samples)",
            "stat",
            [(f"max({sel('onlinerl_feedback_backlog')})", "")],
            width=6,
            height=5,
            thresholds=[(None, "green"), (1000, "orange"), (10000, "red")],
        ),
        Panel(
            "Consumer lag (never delivered)",
            "stat",
            [(f"max({sel('onlinerl_feedback_consumer_lag')})", "")],
            width=6,
            height=5,
            thresholds=[(None, "green"), (1000, "orange"), (10000, "red")],
        ),
        Panel(
            "Feedback rate by outcome",
            "timeseries",
            [(f"sum by (outcome) (rate({sel('onlinerl_feedback_events_total')}[$__rate_interval]))", "{{outcome}}")],
            "ops",
            stacked=True,
            description="accepted_for_training reaches the trainer; unmatched is audited only (poisoning guard).",
        ),
        Panel(
            "Join misses by reason",
            "timeseries",
            [(f"sum by (reason) (rate({sel('onlinerl_feedback_join_misses_total')}[$__rate_interval]))", "{{reason}}")],
            "ops",
            stacked=True,
            description="no_rollout: the rollout record expired or was never written; text_mismatch: the shown "
            "text is not a prefix of what was generated.",
        ),
        Panel(
            "Backlog and consumer lag",
            "timeseries",
            [
                (f"max({sel('onlinerl_feedback_backlog')})", "backlog (XLEN samples)"),
                (f"max({sel('onlinerl_feedback_consumer_lag')})", "consumer lag (group trainers)"),
            ],
            description="Backlog falls only when the trainer acknowledges after a durable checkpoint.",
        ),
        Panel(
            "Continue dev-data uploads by event and schema",
            "timeseries",
            [
                (
                    f"sum by (name, schema) (rate({sel('onlinerl_feedback_continue_events_total')}[$__rate_interval]))",
                    "{{name}} {{schema}}",
                )
            ],
            "ops",
            stacked=True,
            description="Stock Continue's data: destination (/api/training/data): only autocomplete at level all "
            "trains; schema unknown means a Continue upgrade sends a version feedback does not parse (audited).",
        ),
        Panel(
            "Responses by code",
            "timeseries",
            [(f"sum by (code) (rate({sel('onlinerl_feedback_responses_total')}[$__rate_interval]))", "{{code}}")],
            "reqps",
            stacked=True,
            description="429 = backlog over feedback.maxBacklog, 503 = Redis unavailable.",
        ),
        Panel(
            "Contribution limits and quarantine",
            "timeseries",
            [
                (
                    f"sum by (tenant) (increase({sel('onlinerl_feedback_contribution_limited_total')}"
                    "[$__rate_interval]))",
                    "over limit {{tenant}}",
                ),
                (
                    f"sum by (tenant) (increase({sel('onlinerl_feedback_quarantined_total')}[$__rate_interval]))",
                    "quarantined {{tenant}}",
                ),
                (
                    f"sum by (tenant) (increase({sel('onlinerl_feedback_users_quarantined_total')}[$__rate_interval]))",
                    "users quarantined {{tenant}}",
                ),
            ],
            bars=True,
            decimals=0,
            description="Events audited instead of trained: an API key over feedback.limits.maxSamplesPerUserPerHour, "
            "or a key whose accept rate is far above its tenant's (quarantined until an admin releases it).",
        ),
        Panel(
            "Secret findings by kind",
            "timeseries",
            [
                (
                    f"sum by (kind, field) (increase({sel('onlinerl_serving_secret_findings_total')}"
                    "[$__rate_interval]))",
                    "gateway {{field}} {{kind}}",
                ),
                (
                    f"sum by (kind, field) (increase({sel('onlinerl_feedback_secret_findings_total')}"
                    "[$__rate_interval]))",
                    "feedback {{field}} {{kind}}",
                ),
            ],
            bars=True,
            decimals=0,
            description="Credentials found by privacy.secretScreening: the gateway records such a rollout without its "
            "text, the feedback service audits its outcome (secret_detected) and never trains it.",
        ),
        Panel(
            "Silence outcomes (sweeper)",
            "timeseries",
            [(f"sum by (result) (increase({sel('onlinerl_feedback_silence_total')}[$__rate_interval]))", "{{result}}")],
            bars=True,
            decimals=0,
            description="Rollouts of tenants with feedback.silence on that got no outcome within the window: trained "
            "(empty reward) or audited (eval, greedy); rated = a real outcome came first; expired/invalid = skipped.",
        ),
        Panel(
            "Feedback request latency",
            "timeseries",
            [
                (quantile(0.5, "onlinerl_feedback_request_duration_seconds"), "p50"),
                (quantile(0.95, "onlinerl_feedback_request_duration_seconds"), "p95"),
                (quantile(0.99, "onlinerl_feedback_request_duration_seconds"), "p99"),
            ],
            "s",
        ),
        Panel(
            "Rollout records (gateway side of the join)",
            "timeseries",
            [
                (f"sum(rate({sel('onlinerl_serving_rollouts_recorded_total')}[$__rate_interval]))", "recorded"),
                (f"sum(rate({sel('onlinerl_serving_rollout_record_errors_total')}[$__rate_interval]))", "errors"),
            ],
            "ops",
            description="A record error means that completion's feedback can never be joined.",
        ),
    ]
    return dashboard(
        "onlinerl-feedback",
        "OnlineRL · Feedback pipeline",
        "From Continue's accept/reject uploads to training samples on the stream.",
        items,
        "onlinerl_feedback_events_total",
    )


def trainer() -> dict[str, Any]:
    def gauge(metric: str) -> str:
        return f"max({sel(metric)})"

    def per_line(metric: str) -> str:
        """A statistic of each line's last update (issue 39: one series per policy line)."""
        return f"max by (line) ({sel(metric, line=LINE)})"

    items: list[Panel | Row] = [
        Row("Progress"),
        Panel(
            "Published policy version",
            "stat",
            [(f"max({sel('onlinerl_trainer_policy_version', line=SHARED_LABEL)})", "")],
            width=6,
            height=5,
            decimals=0,
            description="The shared policy's line (each project line's: Published version per line).",
        ),
        Panel(
            "Samples/s", "stat", [(f"sum(rate({sel('onlinerl_trainer_samples_total')}[5m]))", "")], width=6, height=5
        ),
        Panel(
            "Steps (1h)",
            "stat",
            [(f"sum(increase({sel('onlinerl_trainer_steps_total')}[1h]))", "")],
            width=6,
            height=5,
            decimals=0,
        ),
        Panel(
            "Since last checkpoint",
            "stat",
            [(f"time() - max({sel('onlinerl_trainer_last_checkpoint_timestamp_seconds')})", "")],
            "s",
            width=6,
            height=5,
            thresholds=[(None, "green"), (900, "orange"), (3600, "red")],
        ),
        Panel(
            "Trainer updates per line",
            "timeseries",
            [
                (
                    f"sum by (line) (increase({sel('onlinerl_trainer_steps_total', line=LINE)}[$__rate_interval]))",
                    "{{line}}",
                )
            ],
            bars=True,
            stacked=True,
            decimals=0,
            description="PPO updates of each policy line's adapter (the shared one and each project's own).",
        ),
        Panel(
            "Published version per line",
            "timeseries",
            [(f"max by (line) ({sel('onlinerl_trainer_policy_version', line=LINE)})", "{{line}}")],
            stepped=True,
            decimals=0,
            description="Each line's latest published version (a project line starts at v0, the shared stable).",
        ),
        Row("PPO"),
        Panel("Loss", "timeseries", [(per_line("onlinerl_trainer_loss"), "{{line}} loss")], width=8),
        Panel(
            "Clip fraction",
            "timeseries",
            [(per_line("onlinerl_trainer_clip_fraction"), "{{line}} clip fraction")],
            "percentunit",
            width=8,
            min=0,
            description="Share of tokens whose ratio hit the PPO clip: high means the policy moved far.",
        ),
        Panel(
            "Approx KL (behaviour → current)",
            "timeseries",
            [(per_line("onlinerl_trainer_approx_kl"), "{{line}} KL")],
            width=8,
        ),
        Panel(
            "Reward and advantage",
            "timeseries",
            [
                (per_line("onlinerl_trainer_reward_mean"), "{{line}} reward mean"),
                (per_line("onlinerl_trainer_advantage_mean"), "{{line}} advantage mean"),
                (per_line("onlinerl_trainer_advantage_std"), "{{line}} advantage std"),
            ],
            width=8,
        ),
        Panel(
            "Importance ratio",
            "timeseries",
            [
                (per_line("onlinerl_trainer_ratio_mean"), "{{line}} mean"),
                (per_line("onlinerl_trainer_ratio_max"), "{{line}} max"),
            ],
            width=8,
        ),
        Panel(
            "Entropy and grad norm",
            "timeseries",
            [
                (per_line("onlinerl_trainer_entropy"), "{{line}} entropy (last update)"),
                (per_line("onlinerl_trainer_entropy_running"), "{{line}} entropy (running: the band's)"),
                (per_line("onlinerl_trainer_grad_norm"), "{{line}} grad norm"),
            ],
            width=8,
        ),
        Panel(
            "KL to base, rejections' share, entropy band",
            "timeseries",
            [
                (per_line("onlinerl_trainer_kl_to_base"), "{{line}} KL to base (adapter off)"),
                (
                    per_line("onlinerl_trainer_negative_advantage_share"),
                    "{{line}} share of samples with negative advantage",
                ),
                (per_line("onlinerl_trainer_entropy_out_of_band"), "{{line}} entropy out of band"),
            ],
            width=24,
            description="Rejections carry gradient when the negative-advantage share is above 0; the KL to the base "
            "policy and the entropy band say whether the policy is collapsing or flattening.",
        ),
        Row("Throughput and staleness"),
        Panel(
            "Samples/s and tokens/s",
            "timeseries",
            [
                (f"sum(rate({sel('onlinerl_trainer_samples_total')}[$__rate_interval]))", "samples/s"),
                (f"sum(rate({sel('onlinerl_trainer_tokens_total')}[$__rate_interval]))", "tokens/s"),
            ],
            width=8,
        ),
        Panel(
            "Step time",
            "timeseries",
            [
                (quantile(0.5, "onlinerl_trainer_step_duration_seconds"), "p50"),
                (quantile(0.95, "onlinerl_trainer_step_duration_seconds"), "p95"),
            ],
            "s",
            width=8,
        ),
        Panel(
            "Skipped steps by reason",
            "timeseries",
            [
                (
                    f"sum by (reason) (increase({sel('onlinerl_trainer_skipped_steps_total')}[$__rate_interval]))",
                    "{{reason}}",
                )
            ],
            width=8,
            bars=True,
            decimals=0,
        ),
        Panel(
            "Sample staleness (versions behind)",
            "timeseries",
            [
                (quantile(0.5, "onlinerl_trainer_sample_staleness_versions"), "p50"),
                (quantile(0.95, "onlinerl_trainer_sample_staleness_versions"), "p95"),
            ],
            width=8,
            min=0,
            description="Policy versions between the one that generated a sample and the one training on it.",
        ),
        Panel(
            "Staleness distribution",
            "heatmap",
            [
                (
                    f"sum by (le) (increase({sel('onlinerl_trainer_sample_staleness_versions_bucket')}"
                    "[$__rate_interval]))",
                    "",
                )
            ],
            width=8,
        ),
        Panel(
            "Stale and inert samples",
            "timeseries",
            [
                (
                    f"sum by (action) (rate({sel('onlinerl_trainer_stale_samples_total')}[$__rate_interval]))",
                    "stale {{action}}",
                ),
                (f"sum(rate({sel('onlinerl_trainer_inert_samples_total')}[$__rate_interval]))", "inert (no gradient)"),
            ],
            "ops",
            width=8,
            stacked=True,
            description="Acknowledged untrained: over the staleness limit, or zero advantage with no KL/entropy.",
        ),
        Panel(
            "Publisher lease held",
            "stat",
            [(f"max({sel('onlinerl_trainer_lease_held')})", "")],
            width=4,
            description="1 when this trainer holds the fenced publisher lease: exactly one trainer may announce "
            "checkpoints and acknowledge samples. 0 on every pod: nobody is training.",
        ),
        Panel(
            "Last step: samples/s and tokens/s",
            "timeseries",
            [
                (gauge("onlinerl_trainer_samples_per_second"), "samples/s"),
                (gauge("onlinerl_trainer_tokens_per_second"), "tokens/s"),
            ],
            width=8,
            description="Throughput of the most recent step alone (the rate panels average over the window).",
        ),
        Panel(
            "Refused and dropped stream entries",
            "timeseries",
            [
                (
                    f"sum by (reason) (increase({sel('onlinerl_trainer_invalid_samples_total')}[$__rate_interval]))",
                    "invalid {{reason}}",
                ),
                (
                    f"sum by (reason) (increase({sel('onlinerl_trainer_dropped_samples_total')}[$__rate_interval]))",
                    "dropped {{reason}}",
                ),
                (
                    f"sum(increase({sel('onlinerl_trainer_corrupt_checkpoints_total')}[$__rate_interval]))",
                    "corrupt checkpoint refused",
                ),
            ],
            width=12,
            bars=True,
            decimals=0,
            description="Acknowledged, never trained: entries that are not a valid TrainingSample (out-of-vocabulary "
            "ids, non-finite numbers...), samples too long to train uncut or already trained into a kept version; "
            "and checkpoints refused at resume because a file no longer matches its manifest.",
        ),
    ]
    return dashboard(
        "onlinerl-trainer",
        "OnlineRL · Trainer",
        "PPO health: loss, clipping, KL, reward, throughput, step time and sample staleness.",
        items,
        "onlinerl_trainer_steps_total",
        line_metric="onlinerl_trainer_steps_total",
    )


def serving() -> dict[str, Any]:
    items: list[Panel | Row] = [
        Row("Policy versions"),
        Panel(
            "Loaded versions",
            "stat",
            [(f"max({sel('onlinerl_reloader_loaded_versions')})", "")],
            width=6,
            height=5,
            decimals=0,
        ),
        Panel(
            "Since last reload",
            "stat",
            [(f"time() - max({sel('onlinerl_reloader_last_reload_timestamp_seconds')})", "")],
            "s",
            width=6,
            height=5,
        ),
        Panel(
            "Reload p95",
            "stat",
            [(quantile(0.95, "onlinerl_reloader_reload_duration_seconds", window="1h"), "")],
            "s",
            width=6,
            height=5,
        ),
        Panel(
            "Abandoned versions (24h)",
            "stat",
            [(f"sum(increase({sel('onlinerl_reloader_failed_versions_total')}[24h]))", "")],
            width=6,
            height=5,
            decimals=0,
            thresholds=[(None, "green"), (1, "red")],
        ),
        Panel(
            "Policy version timeline",
            "timeseries",
            [
                (f"max by (role) ({sel('onlinerl_serving_policy_version', line=SHARED_LABEL)})", "gateway {{role}}"),
                (f"max({sel('onlinerl_reloader_serving_version')})", "reloader serving"),
                (f"max({sel('onlinerl_trainer_policy_version', line=SHARED_LABEL)})", "trainer published"),
            ],
            width=24,
            height=9,
            stepped=True,
            decimals=0,
            description="Trainer publishes, reloader loads, gateway routes: the gap is the learning latency.",
        ),
        Panel(
            "Reload events",
            "timeseries",
            [(f"sum by (result) (increase({sel('onlinerl_reloader_reloads_total')}[$__rate_interval]))", "{{result}}")],
            width=12,
            bars=True,
            decimals=0,
        ),
        Panel(
            "Reload duration",
            "timeseries",
            [
                (quantile(0.5, "onlinerl_reloader_reload_duration_seconds"), "p50"),
                (quantile(0.95, "onlinerl_reloader_reload_duration_seconds"), "p95"),
            ],
            "s",
            width=12,
        ),
        Panel(
            "Refused checkpoint announcements",
            "timeseries",
            [
                (
                    f"sum by (reason) (increase({sel('onlinerl_reloader_refused_announcements_total')}"
                    "[$__rate_interval]))",
                    "{{reason}}",
                )
            ],
            width=24,
            bars=True,
            decimals=0,
            description="Announcements whose path is not {checkpointDir}/{job}/v{N}, or whose manifest or files do "
            "not match: someone else wrote to the checkpoints stream or the volume.",
        ),
        Row("Gateway"),
        Panel(
            "Requests by code",
            "timeseries",
            [(f"sum by (code) (rate({sel(REQ)}[$__rate_interval]))", "{{code}}")],
            "reqps",
            width=8,
            stacked=True,
        ),
        Panel(
            "5xx ratio",
            "timeseries",
            [
                (
                    f"sum(rate({sel(REQ, code='~5..')}[$__rate_interval]))\n/ sum(rate({sel(REQ)}[$__rate_interval]))",
                    "5xx",
                )
            ],
            "percentunit",
            width=8,
            min=0,
        ),
        Panel(
            "In flight and engine up",
            "timeseries",
            [
                (f"sum({sel('onlinerl_serving_inflight_requests')})", "in flight"),
                (f"min({sel('onlinerl_serving_engine_up')})", "engine up (min over replicas)"),
            ],
            width=8,
        ),
        Panel(
            "Request duration by stream",
            "timeseries",
            [
                (quantile(0.5, "onlinerl_serving_request_duration_seconds", by="stream"), "p50 stream={{stream}}"),
                (quantile(0.99, "onlinerl_serving_request_duration_seconds", by="stream"), "p99 stream={{stream}}"),
            ],
            "s",
            width=8,
        ),
        Panel(
            "Time to first token (gateway)",
            "timeseries",
            [
                (quantile(0.5, "onlinerl_serving_ttft_seconds"), "p50"),
                (quantile(0.99, "onlinerl_serving_ttft_seconds"), "p99"),
            ],
            "s",
            width=8,
        ),
        Panel(
            "Gateway overhead",
            "timeseries",
            [
                (quantile(0.5, "onlinerl_serving_gateway_overhead_seconds"), "p50"),
                (quantile(0.99, "onlinerl_serving_gateway_overhead_seconds"), "p99"),
            ],
            "s",
            width=8,
            description="Time the gateway adds on top of vLLM (routing, recording the rollout).",
        ),
        Panel(
            "Rollout records evicted by the per-tenant cap",
            "timeseries",
            [
                (
                    f"sum by (tenant) (rate({sel('onlinerl_serving_rollout_records_evicted_total')}[$__rate_interval]))",
                    "{{tenant}}",
                )
            ],
            "ops",
            width=12,
            description="Records dropped oldest-first when a tenant exceeds serving.maxRecordsPerTenant: their "
            "feedback can no longer join. Raise the cap or lower the record TTL.",
        ),
        Panel(
            "Completions handed to vLLM, by path",
            "timeseries",
            [(f"sum by (via) (rate({sel('onlinerl_serving_engine_calls_total')}[$__rate_interval]))", "{{via}}")],
            "reqps",
            width=12,
            description="How the gateway reached vLLM: socket (sidecar), asgi (vLLM's app in its process), direct "
            "(its completion handler called as a function: in-process, non-streaming). In-process, non-streaming "
            "requests should all be direct; asgi for them means this vLLM lacks the serving API the direct call "
            "needs (the gateway logs why at startup), or ONLINERL_INPROCESS_DIRECT=0.",
        ),
        Row("vLLM engine"),
        Panel(
            "vLLM time to first token",
            "timeseries",
            [
                (quantile(0.5, "vllm:time_to_first_token_seconds"), "p50"),
                (quantile(0.99, "vllm:time_to_first_token_seconds"), "p99"),
            ],
            "s",
            width=8,
        ),
        Panel(
            "vLLM end-to-end latency",
            "timeseries",
            [
                (quantile(0.5, "vllm:e2e_request_latency_seconds"), "p50"),
                (quantile(0.99, "vllm:e2e_request_latency_seconds"), "p99"),
            ],
            "s",
            width=8,
        ),
        Panel(
            "vLLM throughput",
            "timeseries",
            [
                (f"sum(rate({sel('vllm:generation_tokens_total')}[$__rate_interval]))", "generated tokens/s"),
                (f"sum(rate({sel('vllm:prompt_tokens_total')}[$__rate_interval]))", "prompt tokens/s"),
            ],
            width=8,
        ),
        Panel(
            "vLLM KV-cache usage",
            "timeseries",
            [(f"max by (pod) ({sel('vllm:kv_cache_usage_perc')})", "{{pod}}")],
            "percentunit",
            width=12,
            min=0,
            max=1,
        ),
        Panel(
            "vLLM requests running / waiting",
            "timeseries",
            [
                (f"sum({sel('vllm:num_requests_running')})", "running"),
                (f"sum({sel('vllm:num_requests_waiting')})", "waiting"),
            ],
            width=12,
        ),
    ]
    return dashboard(
        "onlinerl-serving",
        "OnlineRL · Serving and policy versions",
        "Policy version timeline, reloads, the gateway and the vLLM engine.",
        items,
        "onlinerl_serving_requests_total",
    )


DASHBOARDS = {
    "onlinerl-learning": learning,
    "onlinerl-feedback": feedback,
    "onlinerl-trainer": trainer,
    "onlinerl-serving": serving,
}


def render_all() -> dict[str, str]:
    """File name -> JSON text, exactly as committed."""
    return {
        f"{name}.json": json.dumps(build(), indent=2, ensure_ascii=False) + "\n" for name, build in DASHBOARDS.items()
    }


def main() -> int:
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    for name, text in render_all().items():
        (OUT_DIR / name).write_text(text)
        print(f"wrote {OUT_DIR / name} ({len(re.findall(chr(34) + 'gridPos', text))} panels)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
