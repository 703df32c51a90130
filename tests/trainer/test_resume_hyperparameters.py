"""A resumed optimizer keeps its moments but takes the configured learning rate, not the one saved with it."""

from __future__ import annotations

import torch

from onlinerl_trainer.engine_torch import TorchEngine
from onlinerl_trainer.policy import load_policy

from .conftest import trainer_config


def test_resume_applies_the_configured_learning_rate(tmp_path, empty_valkey, tiny_model_path):
    old = trainer_config(tmp_path, empty_valkey.url, tiny_model_path, algorithm={"learningRate": 1e-3})
    engine = TorchEngine(load_policy(tiny_model_path, old.trainer), old.trainer)
    loss = sum(p.sum() for p in engine.params)
    loss.backward()
    engine.step()  # creates Adam moments worth keeping
    engine.save_state(tmp_path)

    new = trainer_config(
        tmp_path, empty_valkey.url, tiny_model_path, algorithm={"learningRate": 3e-4, "weightDecay": 0.01}
    )
    resumed = TorchEngine(load_policy(tiny_model_path, new.trainer), new.trainer)
    resumed.load_state(tmp_path)
    groups = resumed.optimizer.param_groups
    assert all(g["lr"] == 3e-4 and g["weight_decay"] == 0.01 for g in groups)
    moments = [s["exp_avg"] for s in resumed.optimizer.state.values()]
    assert moments and any(bool(torch.any(m != 0)) for m in moments)  # the moments came back
