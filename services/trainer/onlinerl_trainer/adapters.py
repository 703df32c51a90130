"""The adapter set (issue 39): one base model in memory, one named LoRA adapter per policy line, each with its own
optimizer.

The shared line's adapter is peft's ``default`` (its checkpoints keep the format they always had); a project's is
``project-<name>`` (``.`` is not allowed in a module name, so it is written ``~``, a character no tenant name has).
peft marks only the active adapter trainable, and each line's optimizer (a plain-torch engine built while that line
was active) holds that line's parameters alone, so an update of one line cannot move another line's tensors.

A new line starts from a checkpoint folder (the shared line's stable version) or, for v0, from a fresh LoRA
initialisation under ``trainer.seed``: the same tensors the shared adapter started from.

Outside an update the shared adapter is the active one (``active`` switches back to the one active before), so
``Learner.engine`` keeps meaning the shared policy.

DeepSpeed is not supported here: one ZeRO engine wraps one optimizer over the whole module, and several engines on
one module (or one optimizer per adapter inside ZeRO's partitions) are not built; ``lines_problem`` refuses that
configuration before anything starts.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from onlinerl.config import OnlineRLConfig, TrainerConfig
from onlinerl.config_rules import project_lines_refusals
from onlinerl.keys import SHARED_LINE
from onlinerl_trainer.engine import Engine, choose_engine_name
from onlinerl_trainer.engine_torch import TorchEngine
from onlinerl_trainer.policy import load_weights_from_checkpoint, save_weights

SHARED_ADAPTER = "default"
_SEED_SCRATCH = "seed-init"


def adapter_key(line: str) -> str:
    """The peft adapter name of a line: ``default`` for the shared line (its files stay as they were)."""
    return SHARED_ADAPTER if line == SHARED_LINE else "project-" + line.replace(".", "~")


def lines_problem(cfg: OnlineRLConfig) -> str | None:
    """Why this trainer cannot keep an adapter per project with ``cfg`` (None: it can, or projects are off): the
    shared config rules of project lines (onlinerl.config_rules.PROJECT_LINE_RULES, also the CRD's CEL rules and
    `onlinerl config check`), with their messages, checked again here for a config that reached the trainer without
    them."""
    return "; ".join(project_lines_refusals(cfg.dump())) or None


def trainer_config_for_lines(cfg: OnlineRLConfig) -> TrainerConfig:
    """``cfg.trainer``, with ``engine: auto`` resolved to plain torch when projects have adapters (auto would pick
    DeepSpeed on a GPU, which cannot hold an optimizer per adapter)."""
    if cfg.projects.adapters != "off" and choose_engine_name(cfg.trainer) == "deepspeed":
        return cfg.trainer.model_copy(update={"engine": "torch"})
    return cfg.trainer


class AdapterSet:
    """The lines' adapters on one peft model and their optimizers (engines), the shared line's included."""

    def __init__(self, module: nn.Module, tcfg: TrainerConfig, shared_engine: Engine) -> None:
        if shared_engine.name != "torch":
            raise ValueError("an adapter per project needs the plain torch engine (adapters.lines_problem)")
        self.module = module
        self.tcfg = tcfg
        self.engines: dict[str, Engine] = {SHARED_LINE: shared_engine}

    def __contains__(self, line: object) -> bool:
        return line in self.engines

    def lines(self) -> list[str]:
        return sorted(self.engines)

    @contextlib.contextmanager
    def active(self, line: str) -> Iterator[Engine]:
        """``line``'s adapter is the one forward passes use and the only trainable one, until the block ends."""
        with self._activated(adapter_key(line)):
            yield self.engines[line]

    @contextlib.contextmanager
    def _activated(self, key: str) -> Iterator[None]:
        previous = self.module.active_adapter
        self.module.set_adapter(key)
        try:
            yield
        finally:
            self.module.set_adapter(previous)

    def add(self, line: str, weights_from: Path | None) -> Engine:
        """A new adapter for ``line``: the seed's fresh LoRA (``weights_from`` None), then a checkpoint's weights."""
        if line in self.engines:
            raise ValueError(f"line {line!r} already has an adapter")
        self._seeded_adapter(adapter_key(line))
        if weights_from is not None:
            load_weights_from_checkpoint(self.module, weights_from, adapter_key(line))
        return self._new_engine(line)

    def reset(self, line: str, weights_from: Path | None) -> Engine:
        """Put ``line``'s adapter back to a checkpoint (None: the seed's fresh LoRA) with a fresh optimizer (a
        rollback's rebase)."""
        key = adapter_key(line)
        if weights_from is not None:
            load_weights_from_checkpoint(self.module, weights_from, key)
        else:
            self._seeded_adapter(_SEED_SCRATCH)
            fresh = self.parameters(_SEED_SCRATCH)
            with torch.no_grad():
                for name, p in self.parameters(key).items():
                    p.copy_(fresh[name])
            previous = self.module.active_adapter
            self.module.delete_adapter(_SEED_SCRATCH)
            self.module.set_adapter(previous)
        return self._new_engine(line)

    def weights(self, line: str) -> dict[str, torch.Tensor]:
        """``line``'s trainable tensors (a copy on the CPU), keyed as the model names them."""
        with self.active(line) as engine:
            return engine.trainable_state_dict()

    def save(self, line: str, weights: dict[str, torch.Tensor], directory: Path) -> None:
        """``line``'s publishable adapter files (the same layout for every line)."""
        save_weights(self.module, weights, directory, adapter_key(line))

    def parameters(self, key: str) -> dict[str, nn.Parameter]:
        """The parameters of one peft adapter, keyed by their name with the adapter's name taken out (so two
        adapters' tensors compare name by name)."""
        marker = f".{key}."
        return {n.replace(marker, "."): p for n, p in self.module.named_parameters() if marker in n}

    def _seeded_adapter(self, key: str) -> None:
        """Add adapter ``key`` initialised as the shared one was (``trainer.seed``), without touching the RNG the
        training draws from."""
        config = copy.deepcopy(self.module.peft_config[SHARED_ADAPTER])
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.tcfg.seed)
            self.module.add_adapter(key, config)

    def _new_engine(self, line: str) -> Engine:
        with self._activated(adapter_key(line)):
            engine = TorchEngine(self.module, self.tcfg)  # its optimizer holds the active adapter's parameters
        self.engines[line] = engine
        return engine
