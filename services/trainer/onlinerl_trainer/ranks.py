"""Data-parallel ranks under the DeepSpeed launcher (or torchrun): one leader talks to Redis, every rank computes.

Only rank 0 (the leader) reads the samples stream, computes advantages, acknowledges, checkpoints and announces.
It broadcasts each piece of work as a command; the followers run the same collate and take their shard of the
micro-batches, so every rank does the same number of forward/backward passes and DeepSpeed's gradient all-reduce
lines up. Commands:

- ``("resume", version)``: first, once the leader holds the trainer lease: the version every rank resumes from;
- ``("train", (samples, advantages))``: one PPO update on this batch;
- ``("gather", None)``: collect the trainable weights (a collective under ZeRO-3);
- ``("save_state", directory)``: write this rank's optimizer partition into the shared ``directory``;
- ``("idle", None)``: nothing to do (keeps followers inside the collective's timeout);
- ``("stop", None)``: leave.

A single process (the default) is a world of one: ``broadcast`` returns its argument and nothing is sent.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

Command = tuple[str, Any]


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world: int = 1

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1

    def connect(self) -> None:
        """Join the process group early (DeepSpeed's own init, so its ``initialize`` reuses the group): the leader
        tells the followers which version to resume before anyone builds a model (``("resume", version)``)."""
        if self.distributed:
            import deepspeed
            import torch.distributed as dist

            from onlinerl_trainer.engine_deepspeed import skip_shm_comm_op

            if not dist.is_initialized():
                skip_shm_comm_op()
                deepspeed.init_distributed()

    def broadcast(self, command: Command | None) -> Command:
        """The leader's ``command`` on every rank (followers pass None and block until it arrives)."""
        if not self.distributed:
            assert command is not None
            return command
        import torch.distributed as dist

        box = [command]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.distributed:
            import torch.distributed as dist

            dist.barrier()

    def sum_tensor(self, values):
        """Element-wise sum over ranks of a 1-d tensor (one all-reduce for all of a step's statistics)."""
        if not self.distributed:
            return values
        import torch.distributed as dist

        out = values.clone()
        dist.all_reduce(out)
        return out


def ranks_from_env(env: os._Environ | dict[str, str] = os.environ) -> Ranks:
    """``RANK`` / ``WORLD_SIZE`` as the DeepSpeed launcher and torchrun set them; a plain start is a world of one."""
    return Ranks(rank=int(env.get("RANK", "0")), world=int(env.get("WORLD_SIZE", "1")))


def shard_slices(slices: list[tuple[int, int]], ranks: Ranks) -> list[tuple[int, int] | None]:
    """This rank's micro-batches, round-robin, padded with ``None`` so every rank runs the same number of passes
    (a ``None`` pass contributes a zero loss but still takes part in the gradient all-reduce)."""
    per_rank = -(-len(slices) // ranks.world)  # ceil
    mine: list[tuple[int, int] | None] = list(slices[ranks.rank :: ranks.world])
    return mine + [None] * (per_rank - len(mine))
