"""Plain torch backend: AdamW over the trainable parameters, global-norm gradient clipping, non-finite guard."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

from onlinerl.config import TrainerConfig
from onlinerl_trainer.engine import StepResult
from onlinerl_trainer.policy import trainable_parameters

OPTIMIZER_FILE = "optimizer.pt"


def make_adamw(params: list[nn.Parameter], cfg: TrainerConfig) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        params, lr=cfg.algorithm.learning_rate, weight_decay=cfg.algorithm.weight_decay, betas=(0.9, 0.95)
    )


def apply_hyperparameters(optimizer: torch.optim.Optimizer, cfg: TrainerConfig) -> None:
    """A resumed optimizer keeps its moments but takes today's learning rate and weight decay: the saved state
    would otherwise silently override a changed ``trainer.algorithm.learningRate``."""
    for group in optimizer.param_groups:
        group["lr"] = cfg.algorithm.learning_rate
        group["weight_decay"] = cfg.algorithm.weight_decay


class TorchEngine:
    name = "torch"

    def __init__(self, module: nn.Module, cfg: TrainerConfig) -> None:
        self.device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        self.module = module.to(self.device)
        self.params = trainable_parameters(module)
        self.optimizer = make_adamw(self.params, cfg)
        self.max_grad_norm = cfg.algorithm.max_grad_norm
        self.cfg = cfg

    def forward(self, **inputs: torch.Tensor | int) -> torch.Tensor:
        return self.module(**inputs).logits

    def backward(self, loss: torch.Tensor, is_boundary: bool) -> None:
        loss.backward()

    def step(self) -> StepResult:
        norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm))
        if not math.isfinite(norm):
            self.discard_gradients()
            return StepResult(grad_norm=norm, skipped=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(grad_norm=norm, skipped=False)

    def discard_gradients(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().clone() for k, v in self.module.named_parameters() if v.requires_grad}

    def save_state(self, directory: Path) -> None:
        torch.save({"optimizer": self.optimizer.state_dict()}, directory / OPTIMIZER_FILE)

    def load_state(self, directory: Path) -> None:
        state = torch.load(directory / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
        self.optimizer.load_state_dict(state["optimizer"])
        apply_hyperparameters(self.optimizer, self.cfg)
