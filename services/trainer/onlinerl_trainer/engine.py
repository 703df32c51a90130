"""What the PPO update needs from an optimizer backend, and the runtime choice between plain torch and DeepSpeed.

Both backends expose the same small surface, so the update (``update.py``) is written once. Gradient accumulation
over micro-batches is explicit: the caller marks the last micro-batch of a step as the boundary.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from onlinerl.config import TrainerConfig


@dataclass
class StepResult:
    grad_norm: float
    skipped: bool  # True when the gradient was non-finite and the optimizer step was not applied


class Engine(Protocol):
    name: str
    module: nn.Module  # the (peft-wrapped) model, unwrapped from any engine; for saving and adapter toggling
    device: torch.device  # where batches must be before forward()

    def forward(self, **inputs: torch.Tensor | int) -> torch.Tensor:
        """Logits of the HF model for keyword inputs (input_ids, attention_mask, position_ids, logits_to_keep)."""
        ...

    def backward(self, loss: torch.Tensor, is_boundary: bool) -> None: ...
    def step(self) -> StepResult: ...
    def discard_gradients(self) -> None: ...
    def trainable_state_dict(self) -> dict[str, torch.Tensor]: ...
    def save_state(self, directory: Path) -> None: ...
    def load_state(self, directory: Path) -> None: ...


def choose_engine_name(cfg: TrainerConfig) -> str:
    """``auto`` = DeepSpeed when a GPU is present (ZeRO pays off there), plain torch on CPU."""
    if cfg.engine != "auto":
        return cfg.engine
    return "deepspeed" if torch.cuda.is_available() else "torch"


def build_engine(module: nn.Module, cfg: TrainerConfig) -> Engine:
    name = choose_engine_name(cfg)
    if name == "deepspeed":
        from onlinerl_trainer.engine_deepspeed import DeepSpeedEngine

        return DeepSpeedEngine(module, cfg)
    from onlinerl_trainer.engine_torch import TorchEngine

    return TorchEngine(module, cfg)
