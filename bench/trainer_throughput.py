"""Trainer throughput: our machinery (stream reads, batching, status, checkpoints + acks) vs a bare torch loop.

Both loops train their own copy of the same policy (same seed, same LoRA init) on the same batches, interleaved step
by step in one process so machine noise hits both alike. The bare loop holds pre-padded tensors in memory and does
forward -> PPO loss -> backward -> clip -> AdamW; the trainer loop reads the batch from a real valkey stream
(XREADGROUP), decodes and collates it, computes advantages, steps, and publishes a verified checkpoint (adapter +
manifest + optimizer state, fsynced) and acknowledges every ``--checkpoint-every`` steps.

    .venv/bin/python bench/trainer_throughput.py --model smollm2 --steps 8
    .venv/bin/python bench/trainer_throughput.py --model tiny --steps 40 --checkpoint-every 1
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--completion-len", type=int, default=32)
    p.add_argument("--checkpoint-every", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    return p.parse_args()


def model_path(which: str) -> Path:
    from onlinerl.model import bootstrap_smollm2, default_cache_dir, make_tiny_model

    smol = bootstrap_smollm2(progress=lambda _m: None)
    if which == "smollm2":
        return smol
    return make_tiny_model(default_cache_dir() / "models" / "tiny-llama-2l", smol)


def make_samples(
    n: int,
    prompt_len: int,
    completion_len: int,
    seed: int,
    *,
    vocab: tuple[int, int] = (100, 40000),
    behaviour: float = -3.0,
    spread: int = 5,
):
    """``n`` rated samples: token ids drawn from ``vocab`` (low, high), behaviour log-probs around ``behaviour``,
    completions ``completion_len`` minus 0 to ``spread - 1`` tokens, accepts and rejects alternating."""
    from onlinerl.schemas import TrainingSample

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        c = max(1, completion_len - i % spread)  # a little length variety, as real completions have
        out.append(
            TrainingSample(
                event_id=f"b{seed}-{i}",
                rollout_id=f"r{seed}-{i}",
                tenant="bench",
                policy_version=0,
                prompt_token_ids=torch.randint(*vocab, (prompt_len,), generator=g).tolist(),
                completion_token_ids=torch.randint(*vocab, (c,), generator=g).tolist(),
                behaviour_logprobs=(behaviour + 0.1 * torch.randn(c, generator=g)).tolist(),
                reward=0.75 if i % 2 else -0.25,
                accepted=bool(i % 2),
            )
        )
    return out


class BareLoop:
    """The reference: plain HF model + peft LoRA + AdamW, tensors already in memory, same loss function."""

    def __init__(self, path: Path, cfg) -> None:
        from onlinerl_trainer.policy import load_policy

        self.model = load_policy(path, cfg)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=cfg.algorithm.learning_rate, betas=(0.9, 0.95))
        self.clip = cfg.algorithm.max_grad_norm

    def step(self, t: dict[str, torch.Tensor]) -> float:
        from onlinerl_trainer.loss import ppo_loss, token_logprobs

        span = t["span"]
        logits = self.model(
            input_ids=t["ids"], attention_mask=t["attn"], position_ids=t["pos"], logits_to_keep=span + 1
        ).logits[:, :-1]  # [B, span, V]
        mask = t["mask"][:, -span:]  # [B, span]
        logp = token_logprobs(logits, t["targets"][:, -span:])  # [B, span]
        out = ppo_loss(logp, t["old"][:, -span:], t["adv"], mask)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return out.loss.item()


def main() -> None:
    args = parse()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import redis

    from onlinerl.config import from_mapping
    from onlinerl.dataplane import samples as samples_stream
    from onlinerl.keys import Keys
    from onlinerl.valkey import EmbeddedValkey
    from onlinerl_trainer.batching import StreamSample, collate
    from onlinerl_trainer.trainer import Trainer

    path = model_path(args.model)
    total = args.warmup + args.steps
    batches = [make_samples(args.batch, args.prompt_len, args.completion_len, seed=s) for s in range(total)]
    with tempfile.TemporaryDirectory() as tmp, EmbeddedValkey(Path(tmp) / "valkey") as vk:
        cfg = from_mapping(
            {
                "job": "bench",
                "model": {"path": str(path), "maxModelLen": max(256, args.prompt_len + args.completion_len)},
                "redis": {"url": vk.url},
                "storage": {"checkpointDir": str(Path(tmp) / "ckpt")},
                "trainer": {
                    "engine": "torch",
                    "batchSize": args.batch,
                    "microBatchSize": args.batch,
                    "batchTimeoutSeconds": 5,
                    "maxSeqLen": max(256, args.prompt_len + args.completion_len),  # >= model.maxModelLen
                    "algorithm": {"baseline": "batch", "staleness": {"maxVersions": 10**6}},
                    "checkpoint": {"everySteps": args.checkpoint_every, "keep": 3},
                },
            }
        )
        client = redis.Redis.from_url(vk.url)
        trainer = Trainer(cfg, client, path)
        trainer.start()
        bare = BareLoop(path, cfg.trainer)
        keys = Keys("bench")

        bare_times, ours_times, tokens = [], [], []
        parts = {"read": 0.0, "train_on": 0.0, "publish": 0.0}
        for i, samples in enumerate(batches):
            # Feedback's XADDs happen outside both timers (another service does them in production).
            for s in samples:
                samples_stream.add(client, keys, s.to_json())
            batch = collate(
                [StreamSample(str(j), s) for j, s in enumerate(samples)], cfg.trainer.max_seq_len, trainer.pad_id
            )
            rewards = batch.rewards
            tensors = {
                "ids": batch.input_ids,
                "attn": batch.attention_mask,
                "pos": batch.position_ids,
                "targets": batch.targets,
                "mask": batch.completion_mask,
                "old": batch.behaviour_logp,
                "adv": rewards - rewards.mean(),
                "span": batch.completion_span,
            }

            t0 = time.perf_counter()
            bare.step(tensors)
            t1 = time.perf_counter()
            entries = trainer.collect()
            ta = time.perf_counter()
            trainer.train_on(entries)
            tb = time.perf_counter()
            if trainer.should_publish():
                trainer.publish()
            t2 = time.perf_counter()
            if i >= args.warmup:
                bare_times.append(t1 - t0)
                ours_times.append(t2 - t1)
                parts["read"] += ta - t1
                parts["train_on"] += tb - ta
                parts["publish"] += t2 - tb
                tokens.append(batch.num_tokens)
        assert samples_stream.length(client, keys) == 0 or args.checkpoint_every > 1
        trainer.close()
        client.close()

    n_tok = sum(tokens)
    bare_s, ours_s = sum(bare_times), sum(ours_times)
    row = {
        "model": args.model,
        "batch": args.batch,
        "prompt+completion": f"{args.prompt_len}+{args.completion_len}",
        "steps": args.steps,
        "ckpt every": args.checkpoint_every,
        "bare samples/s": args.batch * args.steps / bare_s,
        "ours samples/s": args.batch * args.steps / ours_s,
        "bare tok/s": n_tok / bare_s,
        "ours tok/s": n_tok / ours_s,
        "bare step s (median)": statistics.median(bare_times),
        "ours step s (median)": statistics.median(ours_times),
        "overhead % (totals)": 100.0 * (ours_s - bare_s) / bare_s,
        # Paired: step i of both loops ran back to back, so their difference cancels most of the machine's drift.
        "overhead % (median paired)": 100.0
        * statistics.median(o - b for o, b in zip(ours_times, bare_times, strict=True))
        / statistics.median(bare_times),
        "ours ms/step: read / train_on / publish": " / ".join(f"{1000 * v / args.steps:.0f}" for v in parts.values()),
    }
    print(
        f"# {time.strftime('%Y-%m-%d')} {platform.machine()} {os.cpu_count()} cpus, torch {torch.__version__}, "
        f"{args.threads} thread(s)"
    )
    print("| " + " | ".join(row) + " |")
    print("|" + "---|" * len(row))
    print("| " + " | ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in row.values()) + " |")


if __name__ == "__main__":
    main()
