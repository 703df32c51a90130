"""DeepSpeed ZeRO-2/3 backend. bf16 on GPUs; fp32 + gloo on CPU (the tests), where it runs single-process.

Without a launcher, DeepSpeed would try MPI discovery (and fail without mpi4py), so a single process sets the
torch.distributed rendezvous variables itself. Under the DeepSpeed launcher (multi-GPU) they are already set.
DeepSpeed's comm backend would JIT-compile its shared-memory comm op at the first initialisation (g++, about 65 s of
one core, per Python environment): :func:`skip_shm_comm_op` turns that off, since training never uses it.
The client optimizer is the same AdamW as the torch backend, so both backends take the same step on the same batch.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from onlinerl.config import TrainerConfig
from onlinerl.valkey import free_port
from onlinerl_trainer.engine import StepResult
from onlinerl_trainer.engine_torch import apply_hyperparameters, make_adamw
from onlinerl_trainer.policy import trainable_parameters

CHECKPOINT_TAG = "engine"


def ensure_single_process_env() -> None:
    """Rendezvous variables for a one-process group, unless a launcher already provided them."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")


SHM_COMM_OP = "deepspeed_shm_comm"  # deepspeed.ops.op_builder.cpu.comm.ShareMemCommBuilder.NAME


def skip_shm_comm_op() -> None:
    """Tell DeepSpeed its shared-memory comm op is not available, so its comm backend does not build it.

    Why: DeepSpeed's ``TorchBackend`` builds that op at every process's first initialisation, with g++, into
    ~/.cache/torch_extensions (about 65 s of one core on our 2-core machines, again for every new environment: each
    fresh pod, each clean checkout's ``make test``), and it needs a compiler in the image. The op serves only
    ``inference_all_reduce`` (tensor-parallel inference); training's collectives are torch.distributed's (gloo on
    CPU, NCCL on GPUs) whether it is built or not."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__[SHM_COMM_OP] = False  # the probed table DeepSpeed's build_shm_op consults


def deepspeed_config(cfg: TrainerConfig, on_gpu: bool) -> dict[str, Any]:
    """Pure: the DeepSpeed config dict. Gradient accumulation is driven by us (explicit boundaries), so gas = 1."""
    return {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": cfg.algorithm.max_grad_norm,
        "zero_optimization": {"stage": cfg.zero_stage},
        "bf16": {"enabled": on_gpu, "check_grad_overflow": True},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


class DeepSpeedEngine:
    name = "deepspeed"

    def __init__(self, module: nn.Module, cfg: TrainerConfig) -> None:
        import deepspeed

        ensure_single_process_env()
        skip_shm_comm_op()
        on_gpu = torch.cuda.is_available()
        if on_gpu:
            module = module.to(torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))))
        optimizer = make_adamw(trainable_parameters(module), cfg)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=module, optimizer=optimizer, config=deepspeed_config(cfg, on_gpu)
        )
        self.module = self.engine.module
        self.zero_stage = cfg.zero_stage
        self.cfg = cfg
        self.device = self.engine.device

    def forward(self, **inputs: torch.Tensor | int) -> torch.Tensor:
        return self.engine(**inputs).logits

    def backward(self, loss: torch.Tensor, is_boundary: bool) -> None:
        self.engine.set_gradient_accumulation_boundary(is_boundary)
        self.engine.backward(loss, scale_wrt_gas=False)

    def step(self) -> StepResult:
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        norm = float("nan") if norm is None else float(norm)
        # ZeRO skips the update itself (and clears the gradients) when the global norm is not finite.
        return StepResult(grad_norm=norm, skipped=not math.isfinite(norm))

    def discard_gradients(self) -> None:
        self.engine.zero_grad()

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        params = [(k, p) for k, p in self.module.named_parameters() if p.requires_grad]
        if self.zero_stage == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=None):
                return {k: p.detach().float().cpu().clone() for k, p in params}
        return {k: p.detach().float().cpu().clone() for k, p in params}

    def save_state(self, directory: Path) -> None:
        self.engine.save_checkpoint(
            str(directory), tag=CHECKPOINT_TAG, save_latest=False, exclude_frozen_parameters=True
        )

    def load_state(self, directory: Path) -> None:
        self.engine.load_checkpoint(str(directory), tag=CHECKPOINT_TAG, load_module_strict=False)
        apply_hyperparameters(self.engine.optimizer, self.cfg)
