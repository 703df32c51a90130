"""Make LoRA checkpoints the way the trainer publishes them (docs/architecture.md, "Checkpoint layout").

peft on the tiny model, ``lora_B`` initialised non-zero (a fresh LoRA is a no-op otherwise, so versions would be
indistinguishable), saved into ``.tmp-vN-*``, manifest written last, renamed to ``vN``, then XADD to ``checkpoints``.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import redis

from onlinerl.keys import Keys
from onlinerl.lines import checkpoint_root
from onlinerl.schemas import CheckpointManifest


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def make_lora_dir(base_model: Path, out: Path, *, seed: int, rank: int = 8, scale: float = 0.5) -> None:
    """Save a peft LoRA adapter for ``base_model`` into ``out`` with random, clearly non-zero weights."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32)
    lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj", "o_proj"], lora_dropout=0.0)
    peft_model = get_peft_model(model, lora)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn_like(param) * scale)
    peft_model.save_pretrained(out)


def write_lora_checkpoint(
    job: str,
    base_model: Path,
    ckpt_root: Path,
    version: int,
    *,
    seed: int | None = None,
    rank: int = 8,
    corrupt: bool = False,
    line: str = "",
) -> Path:
    """Write ``{ckpt_root}/{job}/v{version}`` (a project ``line``'s: ``{ckpt_root}/{job}/projects/{line}/v{version}``)
    as the trainer does: tmp dir, files, manifest last, atomic rename."""
    job_dir = checkpoint_root(ckpt_root, job, line)
    tmp = job_dir / f".tmp-v{version}-{os.getpid()}"
    tmp.mkdir(parents=True)
    make_lora_dir(base_model, tmp, seed=version if seed is None else seed, rank=rank)
    files = {p.name: _sha256(p) for p in sorted(tmp.iterdir()) if p.is_file()}
    manifest = CheckpointManifest(
        job=job,
        version=version,
        parent_version=version - 1,
        kind="lora",
        base_model=str(base_model),
        step=version,
        files=files,
        line=line,
    )
    (tmp / "manifest.json").write_bytes(manifest.to_json())
    if corrupt:  # bytes changed after the manifest was written: the reloader must refuse it
        with open(tmp / "adapter_model.safetensors", "ab") as f:
            f.write(b"\0")
    final = job_dir / f"v{version}"
    os.replace(tmp, final)
    return final


def lineage(r: redis.Redis, job: str, line: str = "") -> str:
    """The announcement's ``rollback_at`` as the trainer writes it: the trainer rebases onto the last manual rollback
    before it trains again, so a version published now follows that rollback (``0.0``: none yet)."""
    return (r.hget(Keys(job).for_line(line).policy, "rollback_at") or b"0.0").decode()


def announce(r: redis.Redis, job: str, version: int, path: Path, line: str = "") -> None:
    """XADD the ``checkpoints`` entry (the last step of publishing) on ``line``'s stream."""
    r.xadd(
        Keys(job).for_line(line).checkpoints,
        {
            "version": str(version),
            "path": str(path),
            "kind": "lora",
            "manifest_sha256": _sha256(path / "manifest.json"),
            "created_at": repr(time.time()),
            "rollback_at": lineage(r, job, line),
        },
    )


def publish_lora(
    r: redis.Redis,
    job: str,
    base_model: Path,
    ckpt_root: Path,
    version: int,
    *,
    seed: int | None = None,
    rank: int = 8,
    corrupt: bool = False,
    line: str = "",
) -> Path:
    """Write and announce version ``version`` (of project ``line``'s own policy line when given)."""
    path = write_lora_checkpoint(job, base_model, ckpt_root, version, seed=seed, rank=rank, corrupt=corrupt, line=line)
    announce(r, job, version, path, line)
    return path
