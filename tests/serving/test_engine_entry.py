"""``python -m onlinerl_serving.engine``: how the shared library's local stack starts vLLM without importing serving
code. A config it cannot use fails fast with exit 2 and a message naming what to fix (the happy path, exec into vLLM,
is exercised by tests/loop/test_e2e.py through ``onlinerl up``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml


def run_entry(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "onlinerl_serving.engine", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", **(env or {})},
    )


def test_a_missing_config_file_is_named(tmp_path: Path) -> None:
    out = run_entry("--config", str(tmp_path / "nope.yaml"))
    assert out.returncode == 2
    assert f"config file {tmp_path / 'nope.yaml'} does not exist" in out.stderr


def test_an_out_of_range_field_is_named(tmp_path: Path) -> None:
    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump({"model": {"path": str(tmp_path)}, "serving": {"port": 0}}))
    out = run_entry("--config", str(cfg))
    assert out.returncode == 2
    assert "serving.port" in out.stderr and "vllm" not in out.stderr.lower()


def test_no_model_folder_says_how_to_give_one(tmp_path: Path) -> None:
    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump({"model": {"path": ""}}))
    out = run_entry("--config", str(cfg))
    assert out.returncode == 2
    assert "model.path" in out.stderr and "--model" in out.stderr


def test_an_unknown_flag_is_refused_before_anything_starts() -> None:
    out = run_entry("--model-path", "/m")
    assert out.returncode == 2
    assert "unrecognized arguments: --model-path" in out.stderr


def test_the_cpu_check_from_package_metadata_agrees_with_vllms_platform(monkeypatch) -> None:
    """``on_cpu`` reads what vLLM's platform detection reads, without importing vLLM (3 s of CPU per engine start)."""
    from vllm.platforms import current_platform

    from onlinerl_serving.engine import on_cpu

    assert on_cpu() is bool(current_platform.is_cpu())
    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cpu")
    assert on_cpu() is True
