"""Every metric a dashboard or alert uses is really exported: start our services as real processes against a real
valkey, drive a little traffic through them, scrape their /metrics over HTTP, and look each name up with its type
and label names. (vLLM's names are checked against the installed vLLM's source in test_dashboards.py.)"""

from __future__ import annotations

import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from onlinerl.auth import write_keys_file
from onlinerl.procs import Child, python_module, wait_for
from onlinerl.valkey import EmbeddedValkey, free_port
from tests.chart.helm import alert_rules, allowed_series, contract_table, dashboard_exprs, promql_metric_names, render

JOB = "charttest"
TENANT, KEY = "acme", "key-acme-chart-test"
SERIES_SUFFIX = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}


def used_metrics() -> set[str]:
    """Contract metric names (histograms folded) that any dashboard query or alert expression uses."""
    allowed = allowed_series()
    exprs = [e for _, _, e in dashboard_exprs()] + [r["expr"] for r in alert_rules(render(None, True))]
    return {allowed[name] for e in exprs for name in promql_metric_names(e) if name in allowed}


def used_by(component: str) -> list[str]:
    table = contract_table()
    return sorted(m for m in used_metrics() if table[m].component == component)


class Exposition:
    """A parsed /metrics page: family name -> (type, label names seen on its samples)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.families: dict[str, tuple[str, set[str]]] = {}
        self.samples: list[tuple[str, dict[str, str], float]] = []
        for family in text_string_to_metric_families(text):
            self.samples += [(s.name, s.labels, s.value) for s in family.samples]
            labels = {k for s in family.samples for k in s.labels if k not in ("le", "quantile")}
            self.families[family.name] = (family.type, labels)

    def check(self, metric: str) -> None:
        spec = contract_table()[metric]
        family = metric.removesuffix("_total") if spec.kind == "counter" else metric
        assert family in self.families, f"{metric} ({spec.kind}) is not in the {spec.component}'s /metrics"
        kind, labels = self.families[family]
        assert kind == spec.kind, f"{metric}: exported as {kind}, contract says {spec.kind}"
        assert labels <= spec.labels, f"{metric}: labels {sorted(labels)} not in the contract's {sorted(spec.labels)}"
        if not spec.labels:  # unlabelled series exist from the start: the exact series names must be there
            for suffix in SERIES_SUFFIX[spec.kind]:
                series = family + suffix if spec.kind != "gauge" else family
                assert f"\n{series}" in "\n" + self.text or f"\n{series}{{" in "\n" + self.text, series


EVALUATOR = "tests.rollout.evaluators:plain_code"


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path) -> Iterator[dict[str, Exposition]]:
    """Start feedback, gateway (engine down), reloader and trainer; drive traffic; scrape each /metrics once."""
    tmp = tmp_path_factory.mktemp("live")
    valkey = EmbeddedValkey(tmp / "valkey").start()
    keys_file = write_keys_file(tmp / "keys.yaml", {TENANT: [KEY]})
    ports = {name: free_port() for name in ("feedback", "gateway", "reloader", "trainer", "rollout", "dead_engine")}
    config = {
        "job": JOB,
        "redis": {"url": valkey.url},
        "auth": {"apiKeysFile": str(keys_file)},
        "model": {"path": str(tiny_model_path)},
        "serving": {
            "host": "127.0.0.1",
            "port": ports["gateway"],
            "engineUrl": f"http://127.0.0.1:{ports['dead_engine']}",
            "engineConnectTimeoutSeconds": 0.5,
        },
        "storage": {"checkpointDir": str(tmp / "checkpoints")},
        "trainer": {"metricsPort": ports["trainer"], "torchThreads": 1, "batchTimeoutSeconds": 3600},
    }
    (tmp / "config.yaml").write_text(yaml.safe_dump(config))
    env = {"ONLINERL_CONFIG": str(tmp / "config.yaml"), "OMP_NUM_THREADS": "1"}
    children = {
        "feedback": Child(
            "feedback",
            python_module("onlinerl_feedback", "--host", "127.0.0.1", "--port", str(ports["feedback"])),
            tmp / "feedback.log",
            env=env,
        ),
        "gateway": Child("gateway", python_module("onlinerl_serving.gateway"), tmp / "gateway.log", env=env),
        "reloader": Child(
            "reloader",
            python_module("onlinerl_serving.reloader"),
            tmp / "reloader.log",
            env={**env, "ONLINERL_RELOADER_PORT": str(ports["reloader"])},
        ),
        "trainer": Child("trainer", python_module("onlinerl_trainer"), tmp / "trainer.log", env=env),
        "rollout": Child(
            "rollout",
            python_module("onlinerl_rollout", "--interval", "0.5"),
            tmp / "rollout.log",
            # the gate is on by default and needs an evaluator: the fixed one of the rollout tests
            env={**env, "ONLINERL_ROLLOUT_PORT": str(ports["rollout"]), "ONLINERL_ROLLOUT_EVALUATOR": EVALUATOR},
        ),
    }
    urls = {name: f"http://127.0.0.1:{ports[name]}" for name in children}
    try:
        for child in children.values():  # all start at once: their start-ups overlap
            child.start()
        for name, child in children.items():
            child.wait_healthy(f"{urls[name]}/metrics", timeout=120)
        with httpx.Client(timeout=10) as http:
            drive_traffic(http, urls)
            yield {name: Exposition(http.get(f"{urls[name]}/metrics").text) for name in children}
    finally:
        for child in children.values():  # signal all first: their shutdowns overlap too
            child.signal(signal.SIGTERM)
        for child in children.values():
            child.stop()
        valkey.stop()


def drive_traffic(http: httpx.Client, urls: dict[str, str]) -> None:
    """Requests that create labelled series: a completion with the engine down, feedback that joins nothing."""
    auth = {"Authorization": f"Bearer {KEY}"}
    completion = http.post(
        f"{urls['gateway']}/v1/completions",
        headers=auth,
        json={"model": "onlinerl-base", "prompt": "def f(", "max_tokens": 4},
    )
    assert completion.status_code == 503 and "retry-after" in completion.headers, completion.text
    body = {
        "completionId": str(uuid.uuid4()),
        "prompt": "never served",
        "completion": "x = 1",
        "accepted": True,
        "filepath": "file:///a.py",
        "prefix": "",
        "suffix": "",
        "modelProvider": "openai",
        "modelName": "m",
        "timestamp": "2026-11-21T12:00:00Z",
        "time": 10,
        "uniqueId": "u",
        "numLines": 1,
        "cacheHit": False,
    }
    fb = http.post(f"{urls['feedback']}/api/training/submit", headers={**auth, "X-Project-ID": TENANT}, json=body)
    assert fb.status_code == 200, fb.text
    bad = http.post(f"{urls['feedback']}/api/training/submit", headers={**auth, "X-Project-ID": TENANT}, json={})
    assert bad.status_code == 422
    # The gateway counts the request when the response is finished; wait for it, not for a fixed time.
    wait_for(lambda: 'code="503"' in http.get(f"{urls['gateway']}/metrics").text, 10, what="gateway 503 counted")


COMPONENT_OF = {
    "feedback": "feedback",
    "gateway": "gateway",
    "reloader": "reloader",
    "trainer": "trainer",
    "rollout": "rollout controller",
}


@pytest.mark.slow
@pytest.mark.parametrize("service", sorted(COMPONENT_OF))
def test_every_used_metric_is_exported(scraped: dict[str, Exposition], service: str) -> None:
    names = used_by(COMPONENT_OF[service])
    assert names, f"no dashboard or alert uses a {service} metric"
    for metric in names:
        scraped[service].check(metric)


@pytest.mark.slow
def test_traffic_shows_up_with_contract_labels(scraped: dict[str, Exposition]) -> None:
    def value(service: str, name: str, **labels: str) -> float:
        return sum(v for n, lab, v in scraped[service].samples if n == name and labels.items() <= lab.items())

    assert value("gateway", "onlinerl_serving_requests_total", code="503", tenant=TENANT) == 1
    assert value("feedback", "onlinerl_feedback_join_misses_total", reason="no_rollout") == 1
    assert value("feedback", "onlinerl_feedback_events_total", outcome="unmatched", tenant=TENANT) == 1
    assert value("feedback", "onlinerl_feedback_responses_total", code="200") == 1
    assert value("feedback", "onlinerl_feedback_responses_total", code="422") == 1
    assert value("feedback", "onlinerl_feedback_request_duration_seconds_count") >= 1
