"""Model bootstrap: a real SmolLM2 folder from the wheel, idempotent, checksummed, and actually a language model."""

import subprocess
import sys

import pytest

from onlinerl.model import (
    CHECKSUMS_FILE,
    ModelError,
    _write_checksums,
    bootstrap_smollm2,
    resolve_model_path,
    verify_folder,
)


def test_bootstrap_is_idempotent_and_verified(smollm2_path):
    before = {p.name: p.stat().st_mtime_ns for p in smollm2_path.iterdir()}
    messages = []
    again = bootstrap_smollm2(progress=messages.append)
    assert again == smollm2_path
    assert {p.name: p.stat().st_mtime_ns for p in again.iterdir()} == before  # nothing rebuilt
    assert "cached model verified" in messages
    assert verify_folder(smollm2_path)


def test_cli_prints_the_path(smollm2_path):
    proc = subprocess.run(
        [sys.executable, "-m", "onlinerl.cli", "model", "bootstrap"], capture_output=True, text=True, check=True
    )
    assert proc.stdout.strip() == str(smollm2_path)
    assert "[model] verifying" in proc.stderr  # progress on stderr, path alone on stdout


def test_checksum_detects_tampering(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"weights")
    (tmp_path / "config.json").write_text("{}")
    _write_checksums(tmp_path, "src")
    assert verify_folder(tmp_path)
    (tmp_path / "a.bin").write_bytes(b"weightz")
    assert not verify_folder(tmp_path)
    (tmp_path / CHECKSUMS_FILE).unlink()
    assert not verify_folder(tmp_path)


def test_any_hf_folder_through_config(smollm2_path, tmp_path):
    assert resolve_model_path(str(smollm2_path)) == smollm2_path
    with pytest.raises(ModelError, match=r"no config\.json"):
        resolve_model_path(str(tmp_path))


def test_converted_weights_are_a_real_language_model(smollm2_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(134.5e6, rel=0.01)
    ids = tok(
        "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
        return_tensors="pt",
    ).input_ids
    with torch.no_grad():
        nll = model(ids, labels=ids).loss.item()
    assert nll < 2.0  # a random model of this vocabulary scores about ln(49152) = 10.8
