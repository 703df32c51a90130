"""``privacy`` flows like every spec section: from an OnlineRLJob spec, with the defaults the API server fills in
from the generated CRD, through the operator's ConfigMap to what each component loads (issue 38)."""

from __future__ import annotations

import yaml

from onlinerl.config import from_mapping
from onlinerl_operator.render import RenderContext, render_all
from onlinerl_operator.spec import parse_spec
from tests.operator.helpers import example_jobs


def test_a_job_s_privacy_settings_reach_the_component_config() -> None:
    spec = {
        **example_jobs()["demo"],
        "redis": {**example_jobs()["demo"].get("redis", {}), "rolloutTtlSeconds": 1800},  # the CRD default, filled in
        "privacy": {"secretScreening": "block", "retention": {"rolloutRecordsSeconds": 3600, "auditSeconds": 86400}},
    }
    ctx = RenderContext(name="demo", namespace="ns", uid="u-1", cfg=parse_spec("demo", spec), monitoring_api=False)
    [cm] = [m for m in render_all(ctx) if m["kind"] == "ConfigMap" and m["metadata"]["name"] == "demo-config"]
    cfg = from_mapping(yaml.safe_load(cm["data"]["onlinerl.yaml"]))  # what the gateway, feedback and trainer load
    assert cfg.privacy.secret_screening == "block"
    assert cfg.privacy.retention.audit_seconds == 86400
    # the retention value wins over the older field's filled-in default, in what the gateway reads too
    assert cfg.privacy.retention.rollout_records_seconds == cfg.redis.rollout_ttl_seconds == 3600
