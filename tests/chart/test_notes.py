"""The install/upgrade notes print next steps and a Continue configuration that matches what Continue sends.

`helm install --dry-run` needs a cluster, so the notes are rendered through a copy of the chart in which NOTES.txt
becomes a named template shown in a ConfigMap (same engine, same values, --is-upgrade for the upgrade text)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import yaml

from onlinerl.continue_config import continue_config
from onlinerl.fim import get_template
from tests.chart import onboarding
from tests.chart.helm import CHART, VALUES_DIR, helm
from tests.foundation import dockerfiles as df


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


def printed_config(text: str) -> str:
    """The config.yaml block of the notes, unindented (it runs from its first comment to the next blank line)."""
    block = text.split("     # onlinerl for stock Continue", 1)[1].split("\n\n", 1)[0]
    return "\n".join(line[5:] for line in ("     # onlinerl for stock Continue" + block).splitlines()) + "\n"


@pytest.mark.parametrize("max_model_len", [None, 1024, 8192])
def test_install_notes_carry_the_config_onlinerl_up_prints(notes_chart: Path, max_model_len: int | None) -> None:
    extra = ["--set", f"continue.maxModelLen={max_model_len}"] if max_model_len else []
    text = notes(notes_chart, "-f", str(VALUES_DIR / "monitoring-on.yaml"), *extra)
    assert "installed as release" in text
    assert "kubectl -n onlinerl-system rollout status deployment/orl-onlinerl-operator" in text
    printed = printed_config(text)
    local = continue_config(
        model="qwen2.5-coder-1.5b",
        api_base="https://completions.example.com/v1",
        feedback_base="https://completions.example.com",
        api_key="<your-api-key>",
        max_model_len=max_model_len or 2048,
        template=get_template("qwen"),
    )
    assert printed == local  # the same text as `onlinerl up` prints, host and key aside (tests/continue: it loads)
    snippet = yaml.safe_load(printed)
    assert snippet["data"][0]["destination"] == "https://completions.example.com/api/training/data"
    assert "tabAutocompleteOptions" not in snippet
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


# --- onboarding: one keys Secret, the port-forwards, the GPU counts ------------------------------------------------
def test_notes_create_the_keys_secret_every_example_reads(notes_chart: Path, tmp_path: Path) -> None:
    """NOTES create one Secret, the one every example names; none ships its own; its keys.yaml loads as the
    services load it, with a user key and the eval key the rollout gate needs."""
    text = notes(notes_chart, "--set", "continue.project=acme")
    [(secret, literal)] = onboarding.keys_secrets(text)
    assert onboarding.load_keys_literal(literal, tmp_path) == {"user": "acme", "eval": "acme"}
    for path in onboarding.EXAMPLES:
        jobs = [d for d in onboarding.docs(path) if d["kind"] == "OnlineRLJob"]
        assert [j["spec"]["auth"]["apiKeysSecret"] for j in jobs] == [secret], path.name
        shipped = [d for d in onboarding.docs(path) if d["kind"] == "Secret" and "keys.yaml" in d.get("stringData", {})]
        assert not shipped, f"{path.name} ships a keys Secret: applying it would replace the one the user made"


def test_notes_port_forwards_reach_the_job_services(notes_chart: Path) -> None:
    text = notes(notes_chart)
    ctx = onboarding.demo_context()
    assert onboarding.check_port_forwards(text, ctx) == {"demo-serving", "demo-feedback"}
    assert f"apiBase http://127.0.0.1:{ctx.cfg.serving.port}/v1" in text
    assert f"destination http://127.0.0.1:{ctx.cfg.feedback.port}/api/training/data" in text


def test_notes_gpu_counts_match_the_example_headers(notes_chart: Path) -> None:
    text = notes(notes_chart)
    for path in onboarding.EXAMPLES:
        needed = int(re.match(r"GPUs needed: (\d+)", onboarding.header(path)).group(1))
        [line] = [ln for ln in text.splitlines() if f"apply -f examples/{path.name}" in ln]
        said = re.search(r"# (no GPU|\d+ GPUs?)", line).group(1)
        assert said == ("no GPU" if needed == 0 else f"{needed} GPU{'s' if needed > 1 else ''}"), line


def test_notes_name_the_operator_image_make_images_builds(notes_chart: Path) -> None:
    built = df.make_images()
    text = notes(notes_chart)
    image = re.search(r"Its image is (\S+);", text).group(1)
    assert image in built and "`make images`" in text
    moved = df.make_images("IMAGE_REGISTRY=registry.example.com/team", "IMAGE_TAG=dev")
    repository = "operator.image.repository=registry.example.com/team/onlinerl-operator"
    pushed = notes(notes_chart, "--set", f"{repository},operator.image.tag=dev")
    assert re.search(r"Its image is (\S+);", pushed).group(1) in moved  # the override and the chart values agree
