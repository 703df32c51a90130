"""One trainer, many adapters (issue 39): PPO update time and memory with 1 adapter (shared only) vs N (shared + N-1
projects) on one base model, through the trainer's own Learner and AdapterSet (plain torch, CPU).

Each configuration runs in its own process (clean resident memory): load the policy, open N-1 project adapters,
then ``--steps`` rounds in which every line takes one PPO update on its own batch (as the trainer does when a batch
interleaves every line's traffic). Reported per configuration: the median update time, the resident memory after
loading and after training, and the bytes of every line's adapter and of its AdamW moments.

    .venv/bin/python bench/trainer_adapters.py                 # 1 vs 3 adapters on the tiny model
    .venv/bin/python bench/trainer_adapters.py --adapters 1 10 --steps 6
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--adapters", type=int, nargs="+", default=[1, 3], help="configurations: adapters in the trainer")
    p.add_argument("--steps", type=int, default=10, help="rounds (each line one update per round)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--completion-len", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--one", type=int, help=argparse.SUPPRESS)  # run one configuration (a child process)
    return p.parse_args()


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def one(args: argparse.Namespace, adapters: int) -> dict:
    import torch

    from bench.trainer_throughput import make_samples, model_path
    from onlinerl.config import from_mapping
    from onlinerl_trainer.batching import StreamSample, collate
    from onlinerl_trainer.learner import Learner
    from onlinerl_trainer.ranks import Ranks

    torch.set_num_threads(args.threads)
    path = model_path("tiny")
    tcfg = from_mapping(
        {
            "model": {"path": str(path), "maxModelLen": 1024},
            "trainer": {"engine": "torch", "batchSize": args.batch, "microBatchSize": args.batch, "maxSeqLen": 1024},
        }
    ).trainer
    learner = Learner(tcfg, path, Ranks(), lines=True)
    lines = ["", *(f"p{i}" for i in range(1, adapters))]
    for line in lines[1:]:
        learner.adapters.add(line, None)
    loaded = rss_mib()
    batches = {}
    for k, line in enumerate(lines):
        made = make_samples(args.batch, args.prompt_len, args.completion_len, seed=k)
        rows = [StreamSample(f"{k}-{i}", s) for i, s in enumerate(made)]
        batches[line] = (collate(rows, tcfg.max_seq_len, learner.pad_id), torch.tensor([0.5, -0.5] * (args.batch // 2)))
    times: list[float] = []
    for step in range(args.warmup + args.steps):
        for line in lines:
            batch, adv = batches[line]
            t0 = time.perf_counter()
            with learner.on_line(line):
                result = learner.update_batch(batch, adv)
            if step >= args.warmup:
                times.append(time.perf_counter() - t0)
            assert result.skipped_reason is None
    adapter_bytes = {
        line: sum(p.numel() * p.element_size() for p in learner.adapters.engines[line].params) for line in lines
    }
    moment_bytes = {
        line: sum(
            t.numel() * t.element_size()
            for s in learner.adapters.engines[line].optimizer.state.values()
            for t in s.values()
            if torch.is_tensor(t) and t.dim() > 0
        )
        for line in lines
    }
    return {
        "adapters": adapters,
        "updates": len(times),
        "update_median_s": statistics.median(times),
        "update_p90_s": sorted(times)[int(0.9 * (len(times) - 1))],
        "rss_loaded_mib": loaded,
        "rss_trained_mib": rss_mib(),
        "adapter_bytes_each": adapter_bytes[""],
        "adam_moment_bytes_each": moment_bytes[""],
        "lines": len(lines),
    }


def main() -> None:
    args = parse()
    if args.one is not None:
        print(json.dumps(one(args, args.one)))
        return
    results = []
    for n in args.adapters:
        cmd = [sys.executable, __file__, "--one", str(n), "--steps", str(args.steps), "--warmup", str(args.warmup)]
        cmd += ["--batch", str(args.batch), "--prompt-len", str(args.prompt_len)]
        cmd += ["--completion-len", str(args.completion_len), "--threads", str(args.threads)]
        env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'services' / 'trainer'}"}
        with tempfile.TemporaryDirectory() as tmp:
            out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env, cwd=tmp)
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(
        f"tiny model, batch {args.batch} x ({args.prompt_len} prompt + {args.completion_len} completion) tokens, "
        f"{args.threads} thread(s), {args.steps} rounds"
    )
    print(
        "| adapters | update median (s) | update p90 (s) | RSS loaded (MiB) | RSS trained (MiB) "
        "| adapter + Adam (KiB each) |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    for r in results:
        each = (r["adapter_bytes_each"] + r["adam_moment_bytes_each"]) / 1024
        print(
            f"| {r['adapters']} | {r['update_median_s']:.3f} | {r['update_p90_s']:.3f} | {r['rss_loaded_mib']:.0f} | "
            f"{r['rss_trained_mib']:.0f} | {each:.0f} |"
        )


if __name__ == "__main__":
    main()
