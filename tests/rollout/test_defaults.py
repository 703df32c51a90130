"""Canary by default: a config that says nothing about the rollout runs the gate and the canary (local, k8s)."""

from __future__ import annotations

from onlinerl.config import OnlineRLConfig, from_mapping
from onlinerl_operator.render import RenderContext, render_all
from onlinerl_rollout.decision import DecisionRules, Guardrails


def test_empty_config_is_canary_with_gate_and_guardrails() -> None:
    cfg = OnlineRLConfig()
    assert cfg.rollout.strategy == "canary" and cfg.rollout.gate.enabled
    rules = DecisionRules.from_config(cfg.rollout)
    assert (rules.min_samples, rules.min_dwell_seconds) == (50, 120.0) and cfg.rollout.canary_share == 0.25
    assert rules.guardrails == Guardrails(0.8, 0.9, 0.25, 0.1, 2) and rules.max_looks == 5
    dumped = cfg.dump()["rollout"]
    assert dumped["guardrails"]["minAcceptedCharsRatio"] == 0.9 and dumped["gate"]["minAcceptedCharsRatio"] == 0.75


def test_operator_renders_the_controller_for_a_default_spec() -> None:
    ctx = RenderContext(name="j", namespace="ns", uid="u-1", cfg=from_mapping({"job": "j"}))
    deployments = [m["metadata"]["name"] for m in render_all(ctx) if m["kind"] == "Deployment"]
    assert "j-rollout" in deployments
    [ctl] = [m for m in render_all(ctx) if m["metadata"]["name"] == "j-rollout" and m["kind"] == "Deployment"]
    env = {e["name"]: e.get("value") for e in ctl["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["ONLINERL_ROLLOUT_EVALUATOR"] == "onlinerl_rollout.gate_eval:evaluate"
