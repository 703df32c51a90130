"""A reward preset fills only the fields a configuration leaves unset: a value the user gave is never overwritten.

Before: ``{preset: chars, rejected: -0.5}`` trained rejects at -0.25, silently. Now the given field wins, whichever
preset, through every way a config arrives (YAML, environment variables, the operator's spec after the API server
applied the CRD's defaults, and the local stack's dump and reload).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from onlinerl.config import REWARD_PRESETS, OnlineRLConfig, RewardConfig, load_config
from onlinerl.profiles import apply_profile
from onlinerl_operator.crdgen import spec_schema

FIELDS = ("accepted", "accepted_per_char", "accepted_chars_cap", "rejected", "empty")


@pytest.mark.parametrize("preset", ["chars", "cursor", "rlinf", "custom"])
def test_an_explicit_field_wins_over_every_preset(preset):
    cfg = RewardConfig.model_validate({"preset": preset, "rejected": -0.5})
    assert cfg.rejected == -0.5
    table = {**REWARD_PRESETS["chars"], **REWARD_PRESETS.get(preset, {})}
    for name in FIELDS:
        if name != "rejected":
            assert getattr(cfg, name) == table[name], name  # the rest is the preset's


def test_the_issues_example_through_a_yaml_file_and_the_environment(tmp_path: Path):
    f = tmp_path / "c.yaml"
    f.write_text("feedback:\n  reward:\n    rejected: -0.5\n")
    assert load_config(f, environ={}).feedback.reward.rejected == -0.5
    env = {"ONLINERL__FEEDBACK__REWARD__PRESET": "cursor"}
    both = load_config(f, environ=env).feedback.reward
    assert (both.preset, both.accepted, both.rejected) == ("cursor", 0.75, -0.5)


def test_unset_fields_are_the_presets():
    assert RewardConfig() == RewardConfig(preset="chars", **REWARD_PRESETS["chars"])
    assert RewardConfig(preset="cursor").accepted == 0.75
    assert RewardConfig(preset="rlinf").rejected == 0.0


def test_a_dumped_config_reloads_to_the_same_table():
    """`onlinerl up` dumps the effective config for its children; every field is then explicit, with the same
    values: nothing moves on the way."""
    cfg = OnlineRLConfig.model_validate({"feedback": {"reward": {"preset": "cursor", "rejected": -0.5}}})
    again = OnlineRLConfig.model_validate(yaml.safe_load(yaml.safe_dump(cfg.dump())))
    assert again.feedback.reward == cfg.feedback.reward
    profiled, _ = apply_profile(cfg, "cpu")
    assert profiled.feedback.reward == cfg.feedback.reward


def test_the_crd_gives_no_default_that_would_pin_a_field():
    """The API server fills a CRD's defaults into the spec; a default there for ``accepted`` would be a field the
    user "gave" and would override ``preset: cursor`` on every cluster. Only the preset has one."""
    reward = spec_schema()["properties"]["feedback"]["properties"]["reward"]["properties"]
    assert reward["preset"]["default"] == "chars"
    for name in ("accepted", "acceptedPerChar", "acceptedCharsCap", "rejected", "empty"):
        assert "default" not in reward[name], name
    # what the API server hands the operator for `preset: cursor` is still Cursor's table
    spec = {"feedback": {"reward": {"preset": "cursor"}}}
    assert OnlineRLConfig.model_validate(spec).feedback.reward.accepted == 0.75
