"""The operator's status carries the config.yaml for stock Continue, and it is the one `onlinerl up` prints for the
same job: only the host and the key differ (that Continue's own parser loads it: tests/continue/)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from onlinerl.loop.stack import continue_snippet
from onlinerl_operator.render import API_KEY_PLACEHOLDER, RenderContext, endpoints
from onlinerl_operator.spec import parse_spec
from onlinerl_operator.status import JobStatus

ROOT = Path(__file__).resolve().parents[2]
UID = "0b5c1a7e-2f62-4a8e-9d1e-3f1f6f3c8a11"


def job_spec(example: str) -> dict:
    docs = yaml.safe_load_all((ROOT / "examples" / example).read_text())
    return next(d for d in docs if d and d.get("kind") == "OnlineRLJob")["spec"]


@pytest.mark.parametrize("example", ["cpu-demo.yaml", "gpu-lora-qwen-1.5b.yaml"])
@pytest.mark.parametrize("ingress", [False, True])
def test_status_prints_the_local_config_for_the_same_job(example: str, ingress: bool) -> None:
    spec = job_spec(example)
    on = {"enabled": True, "host": "completions.example.com", "tlsSecret": "tls"}
    spec = {**spec, "ingress": on if ingress else {"enabled": False}}
    cfg = parse_spec("demo", spec)
    out = endpoints(RenderContext(name="demo", namespace="team-a", uid=UID, cfg=cfg))
    JobStatus.model_validate({"endpoints": out})  # what the CRD's status schema takes
    printed = out["continueConfig"]
    local = continue_snippet(cfg, API_KEY_PLACEHOLDER, host="HOST")
    if cfg.model.fim_template == "auto":  # the operator cannot read the tokenizer: Continue's choice by name stands
        template = ("      stop:", "    promptTemplates:", "      autocomplete:")
        local = "".join(line for line in local.splitlines(True) if not line.startswith(template))
    serving, feedback = (
        ("https://completions.example.com",) * 2
        if ingress
        else ("http://demo-serving.team-a.svc:8000", "http://demo-feedback.team-a.svc:8002")
    )
    assert printed == local.replace("http://HOST:8000", serving).replace("http://HOST:8002", feedback)
    doc = yaml.safe_load(printed)
    assert doc["data"][0]["destination"] == f"{feedback}/api/training/data"
    assert doc["models"][0]["autocompleteOptions"]["maxPromptTokens"] == 1024
    assert out["feedback"] == "http://demo-feedback.team-a.svc:8002/api/training/data"
