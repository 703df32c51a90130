"""Shared helpers for the chart tests: run the real helm, read the metric contract, pull metric names out of PromQL."""

from __future__ import annotations

import functools
import importlib.util
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import promql_parser
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "onlinerl"
VALUES_DIR = Path(__file__).resolve().parent / "values"
VALUES_FILES = sorted(VALUES_DIR.glob("*.yaml"))
HELM = Path(sys.executable).parent / "helm"
MONITORING_API = "monitoring.coreos.com/v1"
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([str(HELM), *args], capture_output=True, text=True, timeout=120)
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}{proc.stdout}")
    return proc


@functools.lru_cache(maxsize=64)
def render(values: Path | None = None, monitoring_api: bool = False, *extra: str) -> tuple[dict[str, Any], ...]:
    """``helm template`` the chart; returns every non-empty manifest (cached: each combination renders once)."""
    args = ["template", "orl", str(CHART), "--namespace", "onlinerl-system"]
    if values is not None:
        args += ["-f", str(values)]
    if monitoring_api:
        args += ["--api-versions", MONITORING_API]
    out = helm(*args, *extra).stdout
    return tuple(doc for doc in yaml.safe_load_all(out) if doc)


def by_kind(docs: tuple[dict[str, Any], ...], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


# --- the metric contract (docs/architecture.md, "Prometheus metrics") ----------------------------------------------

HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


@dataclass(frozen=True)
class ContractMetric:
    component: str
    kind: str  # counter | gauge | histogram | vllm
    labels: frozenset[str]


@functools.cache
def contract_table() -> dict[str, ContractMetric]:
    """Metric name -> component, type and label names, from the architecture page's table."""
    section = ARCHITECTURE.read_text().split("## Prometheus metrics", 1)[1].split("\n## ", 1)[0]
    table: dict[str, ContractMetric] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 4 or not cells[1].startswith("`"):
            continue
        kind = "vllm" if cells[0] == "vLLM" else cells[2]
        label_cell = re.sub(r"\([^)]*\)", "", cells[3])  # drop the listed values: `outcome` (`a`, `b`)
        labels = frozenset(re.findall(r"`(\w+)`", label_cell))
        for name in re.findall(r"`([a-z_:][a-z0-9_:]*)`", cells[1]):
            table[name] = ContractMetric(cells[0], kind, labels)
    return table


def contract() -> dict[str, str]:
    """Metric name -> type (``counter``/``gauge``/``histogram``/``vllm``)."""
    return {name: m.kind for name, m in contract_table().items()}


@functools.cache
def vllm_metric_types() -> dict[str, str]:
    """vLLM's own metric names and types, read from the installed vLLM's Prometheus logger source."""
    spec = importlib.util.find_spec("vllm")  # located, not imported: importing vLLM takes ~20 s
    assert spec is not None and spec.origin, "vLLM is not installed"
    source = (Path(spec.origin).parent / "v1" / "metrics" / "loggers.py").read_text()
    found = re.findall(r'self\._(gauge|counter|histogram)_cls\(\s*name="(vllm:[a-z0-9_:]+)"', source)
    return {name + ("_total" if kind == "counter" else ""): kind for kind, name in found}


def allowed_series() -> dict[str, str]:
    """Every series name a query may use -> the contract name it belongs to (histograms via their three series)."""
    vllm_types = vllm_metric_types()
    allowed: dict[str, str] = {}
    for name, kind in contract().items():
        if kind == "vllm":
            kind = vllm_types.get(name, "missing-in-vllm")
        if kind == "histogram":
            allowed.update({name + s: name for s in HISTOGRAM_SUFFIXES})
        else:
            allowed[name] = name
    return allowed


# --- PromQL ----------------------------------------------------------------------------------------------------------

# Grafana's variables are not PromQL: give them values of the right kind before parsing.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "1m", "$__range": "1h", "$window": "15m"}


def parse_promql(expr: str) -> promql_parser.Expr:
    """Parse with promql-parser (a port of Prometheus's own parser); raises ValueError on a syntax error."""
    for var, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(var, value)
    return promql_parser.parse(expr)


def promql_metric_names(expr: str) -> set[str]:
    """Names of every vector selector in a PromQL expression (from the syntax tree, not a regex)."""
    names: set[str] = set()

    def visit(node: promql_parser.Expr) -> None:
        if isinstance(node, promql_parser.VectorSelector) and node.name:
            names.add(node.name)

    promql_parser.walk(parse_promql(expr), visit)
    return names


# Labels Prometheus itself puts on every scraped series (target and operator-monitor labels), beside the contract's.
TARGET_LABELS = frozenset(
    {"namespace", "onlinerl_dev_job", "pod", "instance", "job", "container", "service", "endpoint"}
)


def series_labels(series: str) -> frozenset[str] | None:
    """Labels a contract series may carry (its contract labels, the target labels, ``le`` on a histogram's buckets);
    None for a name outside the contract."""
    table = contract_table()
    name = allowed_series().get(series)
    if name is None:
        return None
    extra = {"le"} if series.endswith("_bucket") and series != name else set()
    return table[name].labels | TARGET_LABELS | extra


def _selectors(node: promql_parser.Expr) -> list[promql_parser.VectorSelector]:
    found: list[promql_parser.VectorSelector] = []
    promql_parser.walk(node, lambda n: found.append(n) if isinstance(n, promql_parser.VectorSelector) else None)
    return found


def promql_label_problems(expr: str) -> list[str]:
    """Every label an expression names that its series cannot carry: a matcher's label not on its metric, and a
    ``by``/``without``/``on``/``ignoring``/``group_left`` label on none of the series under it. Such a query parses and
    runs, but shows nothing (or merges what it meant to split): the label check a name check cannot make."""
    problems: list[str] = []

    def carried(selectors: list[promql_parser.VectorSelector]) -> frozenset[str]:
        out: frozenset[str] = frozenset()
        for sel in selectors:
            out |= series_labels(sel.name) or frozenset()
        return out

    def visit(node: promql_parser.Expr) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            allowed = series_labels(node.name)
            for matcher in node.matchers.matchers:
                if allowed is not None and matcher.name not in allowed:
                    problems.append(f"{node.name} has no label {matcher.name!r} (contract: {sorted(allowed)})")
        elif isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
            allowed = carried(_selectors(node.expr))
            for label in node.modifier.labels:
                if label not in allowed:
                    problems.append(f"{node.op} {node.modifier.type} ({label}): no series under it has {label!r}")
        elif isinstance(node, promql_parser.BinaryExpr) and node.modifier is not None:
            allowed = carried(_selectors(node.lhs) + _selectors(node.rhs))
            matching = node.modifier.matching
            for label in [*(matching.labels if matching else []), *(node.modifier.group_labels or [])]:
                if label not in allowed:
                    problems.append(f"vector matching on {label!r}: neither side has it")

    promql_parser.walk(parse_promql(expr), visit)
    return problems


# --- dashboards and alerts -----------------------------------------------------------------------------------------

DASHBOARD_DIR = CHART / "dashboards"


def dashboards() -> dict[str, dict[str, Any]]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARD_DIR.glob("*.json"))}


def dashboard_exprs() -> list[tuple[str, str, str]]:
    """(dashboard file, panel title, expr) for every query, annotation and variable query."""
    out = []
    for name, dash in dashboards().items():
        for panel in dash["panels"]:
            for target in panel.get("targets", []):
                out.append((name, panel["title"], target["expr"]))
        for ann in dash["annotations"]["list"]:
            if "expr" in ann:
                out.append((name, f"annotation {ann['name']}", ann["expr"]))
        for var in dash["templating"]["list"]:
            query = var.get("definition", "")
            m = re.fullmatch(r"label_values\((\w+),\s*\w+\)", query)
            if m:
                out.append((name, f"variable {var['name']}", m.group(1)))
    return out


def variable_queries() -> list[tuple[str, str, str, str]]:
    """(dashboard file, variable, series selector, label) of every ``label_values(selector, label)`` variable."""
    out = []
    for name, dash in dashboards().items():
        for var in dash["templating"]["list"]:
            m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", var.get("definition", ""))
            if m:
                out.append((name, var["name"], m.group(1), m.group(2)))
    return out


def alert_rules(docs: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
    return [rule for pr in by_kind(docs, "PrometheusRule") for group in pr["spec"]["groups"] for rule in group["rules"]]
