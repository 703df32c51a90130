"""Trainer step cost of a LoRA on the last N layers vs on all layers (``trainer.lora.lastLayers``).

One forward + backward of SmolLM2-135M on 8 x 320 tokens (32 completion positions through the vocabulary, as the
trainer does with ``logits_to_keep``), one torch thread, best of 3 per setting, settings interleaved round by round so
machine noise hits them alike. With the adapter on the last N layers autograd stops N layers deep.

    .venv/bin/python bench/lora_layers.py --layers 0,8,4
"""

from __future__ import annotations

import argparse
import time

import torch


def step_seconds(model_path, last_layers: int, x: torch.Tensor) -> float:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.config.use_cache = False
    n = model.config.num_hidden_layers
    extra = {"layers_to_transform": list(range(n - last_layers, n))} if last_layers else {}
    model = get_peft_model(
        model, LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], **extra)
    )
    t = time.perf_counter()
    model(input_ids=x, logits_to_keep=33).logits.float().logsumexp(-1).mean().backward()
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", default="0,8,4", help="comma list of lastLayers values (0 = all layers)")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    from onlinerl.model import bootstrap_smollm2

    torch.set_num_threads(1)
    path = bootstrap_smollm2(progress=lambda _m: None)
    x = torch.randint(0, 1000, (8, 320))
    settings = [int(v) for v in args.layers.split(",")]
    best = {n: float("inf") for n in settings}
    for _ in range(args.rounds):
        for n in settings:
            best[n] = min(best[n], step_seconds(path, n, x))
    base = best[settings[0]]
    print(f"| lastLayers | step s (best of {args.rounds}) | vs first |")
    print("|---|---|---|")
    for n in settings:
        print(f"| {n or 'all'} | {best[n]:.2f} | {base / best[n]:.2f}x |")


if __name__ == "__main__":
    main()
