"""The install/upgrade notes print next steps and a Continue configuration that matches what Continue sends.

`helm install --dry-run` needs a cluster, so the notes are rendered through a copy of the chart in which NOTES.txt
becomes a named template shown in a ConfigMap (same engine, same values, --is-upgrade for the upgrade text)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from tests.chart.helm import CHART, VALUES_DIR, helm


@pytest.fixture(scope="module")
def notes_chart(tmp_path_factory: pytest.TempPathFactory) -> Path:
    chart = tmp_path_factory.mktemp("notes") / "onlinerl"
    shutil.copytree(CHART, chart)
    notes = (chart / "templates" / "NOTES.txt").read_text()
    (chart / "templates" / "NOTES.txt").unlink()
    (chart / "templates" / "_notes_under_test.tpl").write_text(
        '{{- define "test.notes" -}}\n' + notes + "{{- end -}}\n"
    )
    (chart / "templates" / "zz-notes.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes\n"
        'data:\n  notes: {{ include "test.notes" . | toJson }}\n'
    )
    return chart


def notes(chart: Path, *args: str) -> str:
    out = helm(
        "template", "orl", str(chart), "-n", "onlinerl-system", "--show-only", "templates/zz-notes.yaml", *args
    ).stdout
    return yaml.safe_load(out)["data"]["notes"]


def test_install_notes_carry_the_continue_config(notes_chart: Path) -> None:
    text = notes(notes_chart, "-f", str(VALUES_DIR / "monitoring-on.yaml"))
    assert "installed as release" in text
    assert "kubectl -n onlinerl-system rollout status deployment/orl-onlinerl-operator" in text
    after_intro = text.split("~/.continue/config.yaml).", 1)[1].split("\n", 3)[3]
    snippet = yaml.safe_load(after_intro.split("\nObservability")[0])
    (model,) = snippet["models"]
    assert model["provider"] == "openai" and model["roles"] == ["autocomplete"]
    assert model["apiBase"] == "https://completions.example.com/v1" and model["model"] == "qwen2.5-coder-1.5b"
    tracking = snippet["tabAutocompleteOptions"]
    assert tracking["enableCompletionTracking"] is True
    assert tracking["completionTrackingUrl"] == "https://completions.example.com/api/training/submit"
    assert tracking["completionTrackingHeaders"]["Authorization"].startswith("Bearer ")
    assert tracking["completionTrackingHeaders"]["X-Project-ID"] == "acme"
    assert "Alerts: PrometheusRule orl-onlinerl-alerts" in text


def test_upgrade_notes_and_shared_redis(notes_chart: Path) -> None:
    text = notes(notes_chart, "--is-upgrade", "-f", str(VALUES_DIR / "shared-redis.yaml"))
    assert "upgraded (revision" in text and "was upgraded with it" in text
    # each listed job is told its own URL Secret (one user per component), never the admin URL
    assert "demo (namespace team-a):  spec.redis.urlSecret: demo-redis-urls  spec.redis.urlSecretPerUser: true" in text
    assert "second-job (namespace onlinerl-system):  spec.redis.urlSecret: second-job-redis-urls" in text
    assert "redis://admin" not in text and "{.data.admin}" not in text
    assert "<your-ingress-host>" in text, "without continue.baseUrl the notes print a placeholder"
    assert "the monitoring.coreos.com/v1 API is not served" in text
    for example in ("examples/cpu-demo.yaml", "examples/gpu-lora-qwen-1.5b.yaml", "examples/gpu-8x-full-zero3.yaml"):
        assert example in text
