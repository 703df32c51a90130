"""The feedback service refuses to start without a usable tokenizer: a guessed token cut would train on text the user
never saw, so a missing or unsupported tokenizer.json is a start-up error that names ``model.path``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

from onlinerl.auth import write_keys_file


def run_feedback(tmp: Path, model_path: Path) -> subprocess.CompletedProcess:
    cfg = {
        "job": "tok",
        "model": {"path": str(model_path)},
        "auth": {"apiKeysFile": str(write_keys_file(tmp / "keys.yaml", {"acme": ["k-1"]}))},
    }
    (tmp / "config.yaml").write_text(yaml.safe_dump(cfg))
    return subprocess.run(
        [sys.executable, "-m", "onlinerl_feedback", "--redis-url", "redis://127.0.0.1:1/0", "--port", "1"],
        env={"ONLINERL_CONFIG": str(tmp / "config.yaml"), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_missing_tokenizer_fails_start_up_naming_model_path(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    out = run_feedback(tmp_path, model)
    assert out.returncode == 2, out.stderr
    assert "model.path" in out.stderr and "tokenizer.json" in out.stderr


def test_unsupported_decoder_fails_start_up(tmp_path, smollm2_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    data = json.loads((smollm2_path / "tokenizer.json").read_text())
    data["decoder"] = {"type": "WordPiece", "prefix": "##", "cleanup": True}
    (model / "tokenizer.json").write_text(json.dumps(data))
    out = run_feedback(tmp_path, model)
    assert out.returncode == 2, out.stderr
    assert "'WordPiece' is not supported" in out.stderr


def test_not_a_model_folder_fails_start_up(tmp_path):
    out = run_feedback(tmp_path, tmp_path / "nowhere")
    assert out.returncode == 2 and "no config.json" in out.stderr


def test_real_folder_passes_the_tokenizer_check(smollm2_path):
    from onlinerl.config import from_mapping
    from onlinerl_feedback.__main__ import token_table

    table = token_table(from_mapping({"model": {"path": str(smollm2_path)}}))
    assert len(table.pieces) == 49152 and table.pieces[2] == b""
