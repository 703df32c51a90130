"""The trained policy: a Hugging Face causal LM from a folder, with a peft LoRA adapter (default) or fully trained.

With LoRA the KL reference is the same module with the adapter disabled (peft's ``disable_adapter``): no second copy
of the base weights. Full fine-tuning needs a frozen copy, loaded only when the KL penalty is on.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from onlinerl.config import TrainerConfig
from onlinerl_trainer.head_files import tied_embedding_name, write_lm_head


def load_policy(model_path: Path, cfg: TrainerConfig, dtype: torch.dtype = torch.float32) -> nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    model.config.use_cache = False
    if cfg.weights == "lora":
        from peft import LoraConfig, get_peft_model

        layers = model.config.num_hidden_layers
        # More than the model has is every layer: the CPU profile's 8 on a smaller model (the 2-layer test model
        # under `onlinerl up`) is "as deep as it goes", not a reason for the trainer to crash at every start.
        last = min(cfg.lora.last_layers, layers)
        extra = {"layers_to_transform": list(range(layers - last, layers))} if 0 < last < layers else {}
        lora = LoraConfig(
            **extra,
            r=cfg.lora.r,
            lora_alpha=cfg.lora.alpha,
            lora_dropout=cfg.lora.dropout,
            target_modules=list(cfg.lora.target_modules),
            bias="none",
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(model, lora)
    model.train()
    return model


def load_reference(model_path: Path, cfg: TrainerConfig, dtype: torch.dtype = torch.float32) -> nn.Module | None:
    """A frozen base copy for the KL term, only for full fine-tuning with ``kl_coef > 0`` (LoRA needs none)."""
    if cfg.weights == "lora" or cfg.algorithm.kl_coef <= 0:
        return None
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    ref.requires_grad_(False)
    return ref.eval()


def is_lora(model: nn.Module) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


@contextlib.contextmanager
def adapter_disabled(model: nn.Module) -> Iterator[None]:
    with model.disable_adapter():
        yield


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def all_finite(tensors: dict[str, torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors.values())


def load_weights_from_checkpoint(model: nn.Module, version_dir: Path, adapter: str = "default") -> None:
    """Put the weights of a published ``v{N}/`` back into the model (resume); with LoRA into the named ``adapter``
    (per-project adapters, adapters.py: any line's checkpoint fits any adapter of the same config)."""
    from safetensors.torch import load_file

    if is_lora(model):
        from peft import set_peft_model_state_dict

        state = load_file(str(version_dir / "adapter_model.safetensors"))
        result = set_peft_model_state_dict(model, state, adapter_name=adapter)
        unexpected = getattr(result, "unexpected_keys", [])
        if unexpected:
            raise RuntimeError(f"adapter in {version_dir} does not fit the model: unexpected keys {unexpected[:5]}")
        return
    state: dict[str, torch.Tensor] = {}
    for f in sorted(version_dir.glob("model*.safetensors")):
        state.update(load_file(str(f)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]  # tied embeddings are saved once
    if missing or unexpected:
        raise RuntimeError(
            f"weights in {version_dir} do not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )


def save_weights(model: nn.Module, weights: dict[str, torch.Tensor], directory: Path, adapter: str = "default") -> None:
    """The publishable files: LoRA -> adapter_config.json + adapter_model.safetensors (what vLLM's
    /v1/load_lora_adapter and peft read); full -> config.json + model.safetensors, and for a model whose LM head is
    tied to its embeddings also lm_head.safetensors holding the trained embeddings as ``lm_head.weight``: vLLM's
    in-place reload keeps a tied head only when it is given one (onlinerl/tied_head.py). ``adapter``: which named
    LoRA adapter ``weights`` belong to (adapters.py; its name is stripped from the saved keys, so every line's files
    look alike).

    For LoRA this writes the two files directly (peft's save_pretrained also renders a model card and probes the
    hub for the base model's embedding layers, ~10x slower, on the publish path of every version).
    """
    if not is_lora(model):
        model.save_pretrained(directory, state_dict=weights, safe_serialization=True)
        tied = tied_embedding_name(model)
        if tied is not None:
            write_lm_head(directory, weights[tied] if tied in weights else model.get_input_embeddings().weight)
        return
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    tensors = get_peft_model_state_dict(model, state_dict=weights, adapter_name=adapter, save_embedding_layers=False)
    save_file(
        {k: v.contiguous() for k, v in tensors.items()},
        str(directory / "adapter_model.safetensors"),
        metadata={"format": "pt"},
    )
    config = copy.deepcopy(model.peft_config[adapter])
    config.inference_mode = True
    config.save_pretrained(str(directory))
