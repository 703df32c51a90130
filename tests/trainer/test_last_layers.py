"""trainer.lora.lastLayers beyond the model's depth means every layer (the CPU profile's 8 on the 2-layer test model
under `onlinerl up`: the trainer crash-looped at every start before)."""

from __future__ import annotations

from onlinerl.config import TrainerConfig
from onlinerl_trainer.policy import load_policy


def _adapted_layers(model) -> set[str]:
    return {n.split("layers.")[1].split(".")[0] for n, _ in model.named_parameters() if "lora_A" in n}


def test_more_last_layers_than_the_model_has_adapts_every_layer(tiny_model_path):
    every = _adapted_layers(load_policy(tiny_model_path, TrainerConfig(lora={"lastLayers": 0})))
    assert every == {"0", "1"}
    assert _adapted_layers(load_policy(tiny_model_path, TrainerConfig(lora={"lastLayers": 8}))) == every
    assert _adapted_layers(load_policy(tiny_model_path, TrainerConfig(lora={"lastLayers": 1}))) == {"1"}
