"""What the KL penalty references: with LoRA, the base policy is the same module with the adapter switched off
(peft ``disable_adapter``), not the previous version and not a second copy of the weights."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from onlinerl.config import TrainerConfig
from onlinerl_trainer.loss import kl_penalty, token_logprobs
from onlinerl_trainer.policy import adapter_disabled, load_policy


def _logprobs(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return token_logprobs(model(input_ids=ids).logits[:, :-1], ids[:, 1:])  # [1, T-1]


def test_adapter_off_is_the_base_policy(tiny_model_path: Path):
    policy = load_policy(tiny_model_path, TrainerConfig())
    with torch.no_grad():  # a trained adapter: LoRA's B starts at zero, so give it weights
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    ids = torch.arange(3, 40).unsqueeze(0)  # [1, 37]

    trained, base_lp = _logprobs(policy, ids), _logprobs(base, ids)
    with adapter_disabled(policy):
        reference = _logprobs(policy, ids)
    assert torch.allclose(reference, base_lp, atol=1e-5)  # adapter off == base weights, token by token
    assert not torch.allclose(trained, base_lp, atol=1e-3)  # the adapter moved the policy
    kl = kl_penalty(trained, reference, "k3")
    assert float(kl.min()) >= 0.0 and float(kl.mean()) > 1e-4  # k3 is never negative, and positive once moved
    assert float(kl_penalty(base_lp, reference, "k3").abs().max()) < 1e-5
