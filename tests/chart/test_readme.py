"""The chart README documents every value (table generated from values.yaml), and the paths it and the notes point
users at (examples, images) exist."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import yaml

from tests.chart import onboarding
from tests.chart.helm import CHART, ROOT


def _values_table_module():
    spec = importlib.util.spec_from_file_location("values_table", CHART / "hack" / "values_table.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


def test_values_table_is_current_and_complete() -> None:
    gen = _values_table_module()
    readme = (CHART / "README.md").read_text()
    assert readme.split(gen.MARKER, 1)[1].strip() == gen.table().strip(), (
        "README values table is stale: run charts/onlinerl/hack/values_table.py --write"
    )
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    documented = gen.documented_keys((CHART / "values.yaml").read_text())

    def leaves(node: dict, prefix: str = ""):
        for key, value in node.items():
            path = f"{prefix}{key}"
            if path in documented:
                continue
            assert isinstance(value, dict) and value, f"values.yaml key {path} has no '# --' description"
            yield from leaves(value, path + ".")

    assert not list(leaves(values))


def test_referenced_files_exist() -> None:
    text = (CHART / "README.md").read_text() + (CHART / "templates" / "NOTES.txt").read_text()
    examples = set(re.findall(r"examples/[\w.-]+\.yaml", text))
    assert len(examples) == 3
    for path in examples:
        assert (ROOT / path).is_file(), f"{path} is referenced but missing"
        kinds = [d["kind"] for d in yaml.safe_load_all((ROOT / path).read_text()) if d]
        assert "OnlineRLJob" in kinds, path
    for image in re.findall(r"\]\((docs/[\w.-]+\.png)\)", text):
        assert (CHART / image).is_file(), image


def test_readmes_and_the_demo_header_give_the_same_onboarding(tmp_path: Path) -> None:
    """The README, the chart README and the cpu-demo header create the Secret the examples read, with keys the
    services load; the port-forwards name the demo's rendered Services, and the header's sed turns the job's status
    config into one for those forwards."""
    ctx = onboarding.demo_context()
    texts = {
        "README.md": (ROOT / "README.md").read_text(),
        "charts/onlinerl/README.md": (CHART / "README.md").read_text(),
        "examples/cpu-demo.yaml": onboarding.header(onboarding.CPU_DEMO),
    }
    for where, text in texts.items():
        [(secret, literal)] = onboarding.keys_secrets(text)
        assert secret == ctx.cfg.auth.api_keys_secret, where
        assert set(onboarding.load_keys_literal(literal, tmp_path)) == {"user", "eval"}, where
    for where in ("README.md", "examples/cpu-demo.yaml"):
        assert onboarding.check_port_forwards(texts[where], ctx) == {"demo-serving", "demo-feedback"}, where
    local = onboarding.local_continue_config(ctx)
    assert local["models"][0]["apiBase"] == f"http://127.0.0.1:{ctx.cfg.serving.port}/v1"
    assert local["data"][0]["destination"] == f"http://127.0.0.1:{ctx.cfg.feedback.port}/api/training/data"
    assert ".svc" not in yaml.safe_dump(local)
    assert f"http://127.0.0.1:{ctx.cfg.serving.port}/v1" in texts["README.md"]
