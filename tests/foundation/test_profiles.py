"""The hardware profile `onlinerl up` applies: CPU-only machines get the CPU defaults, an explicit value always wins,
and the demonstration needs no file of its own to get them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

from onlinerl.config import from_mapping
from onlinerl.profiles import CPU_PROFILE, apply_profile, gpu_present, select_profile, with_local_profile

ROOT = Path(__file__).resolve().parents[2]


def test_auto_selects_cpu_without_a_gpu_and_the_documented_defaults_with_one() -> None:
    cfg = from_mapping({})
    assert select_profile(cfg, has_gpu=False) == "cpu"
    assert select_profile(cfg, has_gpu=True) == "none"
    assert select_profile(from_mapping({"profile": "cpu"}), has_gpu=True) == "cpu"  # asked for: applied anyway
    assert select_profile(from_mapping({"profile": "none"}), has_gpu=False) == "none"
    gpu_box = with_local_profile(cfg, has_gpu=True)
    assert gpu_box.trainer.lora.last_layers == 0 and gpu_box.trainer.algorithm.ppo_epochs == 1
    assert gpu_box.model.max_model_len == 2048 and gpu_box.profile == "none"


def test_cpu_profile_fills_every_unset_field_and_never_an_explicit_one() -> None:
    out, applied = apply_profile(from_mapping({}), "cpu")
    assert applied == CPU_PROFILE
    assert (out.trainer.lora.last_layers, out.trainer.torch_threads, out.model.max_model_len) == (8, 1, 1024)
    assert (out.trainer.algorithm.ppo_epochs, out.trainer.algorithm.learning_rate) == (4, 2e-4)
    assert (out.trainer.checkpoint.every_steps, out.trainer.checkpoint.every_seconds) == (2, 120.0)
    assert out.trainer.max_seq_len == 1024 and out.profile == "cpu"
    assert (out.rollout.canary_share, out.rollout.max_looks, out.rollout.strategy) == (0.5, 1, "canary")
    # a field neither the config nor the profile set stays unset: later steps still tell a default from a choice
    assert "max_samples_per_user_per_hour" not in out.feedback.limits.model_fields_set
    assert "preset" not in out.feedback.reward.model_fields_set
    # the product's algorithm and reward are not the profile's business
    default = from_mapping({})
    assert out.trainer.algorithm.kl_coef == default.trainer.algorithm.kl_coef
    assert out.feedback.reward.preset == default.feedback.reward.preset

    mine = from_mapping(
        {"trainer": {"lora": {"lastLayers": 0}, "algorithm": {"ppoEpochs": 2}}, "model": {"maxModelLen": 2048}}
    )
    out, applied = apply_profile(mine, "cpu")
    assert out.trainer.lora.last_layers == 0 and out.trainer.algorithm.ppo_epochs == 2
    assert "trainer.lora.lastLayers" not in applied and "model.maxModelLen" not in applied
    # the trainer still takes whatever vLLM is allowed to serve (never a cut sample)
    assert out.model.max_model_len == 2048 and out.trainer.max_seq_len == 2048
    # a sibling of an explicit field still gets the profile
    assert out.trainer.algorithm.learning_rate == 2e-4
    # rejects are subsampled; the product's weight (0.05, not the profile's business) makes a kept one carry its own A
    assert (out.trainer.algorithm.negative_sample_rate, out.trainer.algorithm.negative_weight) == (0.05, 0.05)
    assert "negative_weight" not in out.trainer.algorithm.model_fields_set


def test_gpu_detection_reads_device_nodes_and_respects_an_empty_device_list(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert not gpu_present(tmp_path)
    (tmp_path / "nvidia0").touch()
    assert gpu_present(tmp_path)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert not gpu_present(tmp_path)


def _config_show(cwd: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    """The real CLI on this GPU-less machine, with no ONLINERL__* variables from the caller."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ONLINERL__")}
    return subprocess.run(
        [sys.executable, "-m", "onlinerl.cli", "config", "show", *flags],
        capture_output=True,
        text=True,
        env={**env, "CUDA_VISIBLE_DEVICES": ""},
        cwd=cwd,
        timeout=120,
        check=True,
    )


def test_config_show_local_prints_what_onlinerl_up_runs(tmp_path) -> None:
    """Through the real CLI: the profile's values, and on stderr what was applied."""
    run = _config_show(tmp_path, "--local")
    shown = yaml.safe_load(run.stdout)
    assert shown["profile"] == "cpu" and shown["trainer"]["lora"]["lastLayers"] == 8
    assert shown["trainer"]["algorithm"]["ppoEpochs"] == 4 and shown["model"]["maxModelLen"] == 1024
    assert "hardware profile cpu" in run.stderr and "trainer.lora.lastLayers=8" in run.stderr
    plain = yaml.safe_load(_config_show(tmp_path).stdout)
    assert plain["trainer"]["lora"]["lastLayers"] == 0  # what every component validates: no profile


def test_the_local_stack_still_lifts_the_per_key_hourly_limit_after_the_profile(tmp_path) -> None:
    """Regression: the profile once marked every field set, so `onlinerl up` kept the 1000-per-key-hour limit and a
    60-minute demo's events past the 1000th were audited (contribution_limit), never trained."""
    from onlinerl.loop.stack import StackPaths, effective_config

    def local(cfg):
        return effective_config(with_local_profile(cfg, has_gpu=False), StackPaths(tmp_path), "redis://x:1/0", tmp_path)

    for cfg in (from_mapping({}), from_mapping({"job": "demo"})):  # the defaults, and configs/demo.yaml
        assert local(cfg).feedback.limits.max_samples_per_user_per_hour == 0
        assert local(cfg).trainer.lora.last_layers == 8
    local = local(from_mapping({"feedback": {"limits": {"maxSamplesPerUserPerHour": 50}}}))
    assert local.feedback.limits.max_samples_per_user_per_hour == 50  # a limit someone set is kept


def test_the_local_stack_lets_a_lone_developer_decide_its_canary_unless_told_otherwise(tmp_path) -> None:
    """`onlinerl up` is one developer: its canary may be decided by few users (rollout.fewUsers: decide, issue 36);
    the product's default for every other deployment is wait, and a value someone set is kept."""
    from onlinerl.loop.stack import StackPaths, effective_config

    def local(cfg):
        return effective_config(with_local_profile(cfg, has_gpu=False), StackPaths(tmp_path), "redis://x:1/0", tmp_path)

    assert from_mapping({}).rollout.few_users == "wait"
    assert local(from_mapping({})).rollout.few_users == "decide"
    assert local(from_mapping({"rollout": {"fewUsers": "wait"}})).rollout.few_users == "wait"
