"""Dashboards and alerts: JSON parses, layout is sane, the generator and the committed JSON agree, the PNGs exist and
are referenced, every panel topic the issue asks for is there, and every metric name is in the contract."""

from __future__ import annotations

import hashlib
import importlib.util
import re
import sys

import pytest

from tests.chart.helm import (
    CHART,
    DASHBOARD_DIR,
    alert_rules,
    allowed_series,
    contract,
    dashboard_exprs,
    dashboards,
    parse_promql,
    promql_label_problems,
    promql_metric_names,
    render,
    series_labels,
    variable_queries,
    vllm_metric_types,
)

RENDERER = "tools/render_dashboards.py"
# Dashboards with a `line` variable (issue 39): each policy line's figures side by side.
LINE_DASHBOARDS = {"onlinerl-learning.json", "onlinerl-trainer.json"}
# Gauges of a version: one line's figure, meaningless summed or maxed over lines.
VERSION_GAUGES = {"onlinerl_serving_policy_version", "onlinerl_trainer_policy_version"}
REQUIRED_PANELS = {
    "onlinerl-learning.json": [
        "Accept rate by policy version and arm",
        "Suggestions per request by arm",
        "Accepted per 100 requests by arm",
        "Served version per line",
        "Accept rate per line",
        "Canary share per line",
        "Canary verdict per line",
        "Feedback outcomes per line",
        "Mean reward per line",
    ],
    "onlinerl-feedback.json": ["Feedback rate by outcome", "Join misses by reason", "Backlog and consumer lag"],
    "onlinerl-trainer.json": [
        "Loss",
        "Clip fraction",
        "Approx KL (behaviour → current)",
        "Reward and advantage",
        "Samples/s and tokens/s",
        "Step time",
        "Sample staleness (versions behind)",
        "Trainer updates per line",
        "Published version per line",
    ],
    "onlinerl-serving.json": [
        "Policy version timeline",
        "Reload events",
        "vLLM time to first token",
        "vLLM end-to-end latency",
        "vLLM throughput",
        "vLLM KV-cache usage",
    ],
}
REQUIRED_ALERTS = {
    "OnlineRLCandidateAcceptRateRegression",
    "OnlineRLTrainerStalled",
    "OnlineRLFeedbackBacklogGrowing",
    "OnlineRLReloadFailures",
    "OnlineRLFeedbackServerErrors",
    "OnlineRLFeedbackThrottling",
    "OnlineRLServingErrorRate",
    "OnlineRLContributionLimited",
    "OnlineRLUserQuarantined",
    "OnlineRLCheckpointAnnouncementRefused",
}


def test_every_dashboard_parses_and_is_laid_out_on_the_grid() -> None:
    dash = dashboards()
    assert set(dash) == set(REQUIRED_PANELS)
    uids = set()
    for name, d in dash.items():
        assert d["uid"] not in uids and len(d["uid"]) <= 40
        uids.add(d["uid"])
        ids = [p["id"] for p in d["panels"]]
        assert len(ids) == len(set(ids)), f"{name}: duplicate panel ids"
        cells: set[tuple[int, int]] = set()
        for p in d["panels"]:
            g = p["gridPos"]
            assert g["x"] >= 0 and g["x"] + g["w"] <= 24 and g["h"] > 0, (name, p["title"])
            box = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
            assert not box & cells, f"{name}: panel {p['title']!r} overlaps another"
            cells |= box
            if p["type"] != "row":
                assert p["targets"] and p["datasource"]["uid"] == "${datasource}"
        titles = {p["title"] for p in d["panels"]}
        missing = [t for t in REQUIRED_PANELS[name] if t not in titles]
        assert not missing, f"{name} lacks panels {missing}"
        variables = {v["name"] for v in d["templating"]["list"]}
        assert {"datasource", "namespace"} <= variables


def test_committed_json_is_the_generator_output() -> None:
    spec = importlib.util.spec_from_file_location("dashboards_gen", CHART / "hack" / "dashboards.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    for name, text in module.render_all().items():
        assert (DASHBOARD_DIR / name).read_text() == text, (
            f"{name} differs from charts/onlinerl/hack/dashboards.py: run it to regenerate"
        )


def test_every_query_filters_by_namespace_and_job_and_parses() -> None:
    """Two OnlineRLJobs in one namespace must not merge: every selector also filters by the job variable (the series'
    onlinerl_dev_job label, the operator monitors' target label)."""
    for name, title, expr in dashboard_exprs():
        parse_promql(expr)  # raises on a syntax error
        if not title.startswith("variable"):
            for selector in re.findall(r"[a-z_:]+\{[^}]*\}", expr):
                assert 'namespace=~"$namespace"' in selector, (name, title, selector)
                assert 'onlinerl_dev_job=~"$job"' in selector, (name, title, selector)


def test_job_variable_lists_the_jobs_of_the_chosen_namespaces() -> None:
    from onlinerl_operator import constants as c
    from onlinerl_operator.render_scaling import JOB_LABEL

    assert JOB_LABEL == "onlinerl_dev_job" and c.LABEL_JOB == "onlinerl.dev/job"  # Prometheus's spelling of it
    for name, board in dashboards().items():
        variables = {v["name"]: v for v in board["templating"]["list"]}
        job = variables["job"]
        assert job["includeAll"] and job["multi"] and job["allValue"] == ".*", name
        assert job["definition"].endswith(f'{{namespace=~"$namespace"}}, {JOB_LABEL})'), name
        order = [v["name"] for v in board["templating"]["list"]]
        assert order.index("namespace") < order.index("job"), name  # Grafana resolves variables in order


def test_every_dashboard_metric_is_in_the_contract() -> None:
    allowed = allowed_series()
    used = set()
    for name, title, expr in dashboard_exprs():
        for metric in promql_metric_names(expr):
            assert metric in allowed, f"{name} / {title}: {metric} is not a contract metric (docs/architecture.md)"
            used.add(allowed[metric])
    unused = set(contract()) - used
    assert not unused, f"contract metrics on no dashboard: {sorted(unused)}"


def test_every_query_names_only_labels_its_series_carry(rules: list[dict]) -> None:
    """A matcher, ``by``/``without`` or vector-matching label that the contract gives none of the series under it
    (docs/architecture.md): such a panel parses and runs but shows nothing, so the name check alone lets it pass."""
    exprs = [(f"{name} / {title}", expr) for name, title, expr in dashboard_exprs()]
    exprs += [(f"alert {rule['alert']}", rule["expr"]) for rule in rules]
    for where, expr in exprs:
        assert not promql_label_problems(expr), f"{where}: {promql_label_problems(expr)}"
    for name, variable, selector, label in variable_queries():
        assert not promql_label_problems(selector), (name, variable)
        for metric in promql_metric_names(selector):
            assert label in (series_labels(metric) or ()), f"{name}: variable {variable} lists {label!r} of {metric}"


def test_the_label_checker_itself() -> None:
    assert promql_label_problems('sum by (line) (rate(onlinerl_feedback_accepted_total{arm="stable"}[5m]))') == []
    assert (
        promql_label_problems(
            "histogram_quantile(0.5, sum by (le) (rate(onlinerl_trainer_step_duration_seconds_bucket[5m])))"
        )
        == []
    )
    problems = promql_label_problems("sum by (line) (rate(onlinerl_trainer_samples_total[5m]))")  # no line there
    assert problems == ["sum AggModifierType.By (line): no series under it has 'line'"]
    assert promql_label_problems('onlinerl_serving_requests_total{line="acme"}')  # requests are not per line
    assert promql_label_problems("max without (role) (onlinerl_trainer_policy_version)")
    assert promql_label_problems("onlinerl_trainer_loss / on (arm) onlinerl_trainer_approx_kl")
    assert promql_label_problems("sum by (le) (onlinerl_trainer_loss)")  # le: histogram buckets only


def test_per_line_panels_split_by_the_line_variable() -> None:
    """The line dashboards list the lines of the chosen jobs; every panel titled per line filters by the variable and
    groups by ``line``; a version gauge is never summed or maxed across lines (acme's v3 is not the shared v3): it is
    grouped by line or pinned to the shared line."""
    boards = dashboards()
    for name in LINE_DASHBOARDS:
        order = [v["name"] for v in boards[name]["templating"]["list"]]
        assert "line" in order and order.index("job") < order.index("line"), name
    per_line = [(n, t, e) for n, t, e in dashboard_exprs() if t.endswith("per line")]
    assert {n for n, _, _ in per_line} == LINE_DASHBOARDS
    for name, title, expr in per_line:
        assert 'line=~"$line"' in expr and re.search(r"by \([^)]*\bline\b", expr), (name, title, expr)
    for name, title, expr in dashboard_exprs():
        for metric in promql_metric_names(expr) & VERSION_GAUGES:
            grouped = re.search(r"by \([^)]*\bline\b[^)]*\) \(" + re.escape(metric), expr)
            shared = re.search(re.escape(metric) + r'\{[^}]*line="shared"', expr)
            assert grouped or shared, (name, title, expr)


def test_vllm_names_are_real_vllm_metrics() -> None:
    real = vllm_metric_types()
    for name, kind in contract().items():
        if kind == "vllm":
            assert name in real, f"{name} is not a metric of the installed vLLM"
    assert real["vllm:kv_cache_usage_perc"] == "gauge"
    assert real["vllm:time_to_first_token_seconds"] == "histogram"


@pytest.fixture(scope="module")
def rules() -> list[dict]:
    return alert_rules(render(None, True))


def test_required_alerts_exist(rules: list[dict]) -> None:
    assert {r["alert"] for r in rules} >= REQUIRED_ALERTS


def test_every_alert_metric_is_in_the_contract(rules: list[dict]) -> None:
    allowed = allowed_series()
    for rule in rules:
        names = promql_metric_names(rule["expr"])
        assert names, rule["alert"]
        for metric in names:
            assert metric in allowed, f"alert {rule['alert']}: {metric} is not a contract metric"


def test_the_promql_extractor_itself() -> None:
    expr = (
        'histogram_quantile(0.95, sum by (le, stream) (rate(x_seconds_bucket{a="b", c=~"d|e"}[5m])))\n'
        '/ on (namespace) group_left max(up offset 1h) > bool 0.5 and vllm:kv_cache_usage_perc{x="1e3"}'
    )
    assert promql_metric_names(expr) == {"x_seconds_bucket", "up", "vllm:kv_cache_usage_perc"}
    assert promql_metric_names('rate(y_total{namespace=~"$namespace"}[$__rate_interval])') == {"y_total"}
    with pytest.raises(ValueError):
        promql_metric_names("sum(rate(x[5m])")


def test_layout_images_exist_and_are_referenced() -> None:
    readme = (CHART / "README.md").read_text()
    for name in dashboards():
        png = CHART / "docs" / name.replace(".json", ".png")
        assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
        digest = "sha256:" + hashlib.sha256((DASHBOARD_DIR / name).read_bytes()).hexdigest()
        assert digest.encode() in png.read_bytes(), f"{png.name} was not drawn from the current JSON: run {RENDERER}"
        assert f"docs/{png.name}" in readme
