"""Full fine-tuning (``trainer.weights: full``): publishes config + safetensors a plain HF load reproduces; resumes."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from onlinerl.tied_head import BASE_DIR, LM_HEAD_FILE, LM_HEAD_KEY, base_weights_path
from onlinerl_trainer.trainer import Trainer

from .conftest import make_sample, trainer_config, xadd_samples

PROMPT = [1604, 803, 24, 81, 28, 278, 727]


def test_full_weights_publish_load_and_resume(tmp_path, redis_client, empty_valkey, tiny_model_path):
    cfg = trainer_config(
        tmp_path / "ckpt",
        empty_valkey.url,
        tiny_model_path,
        weights="full",
        batchSize=4,
        algorithm={"learningRate": 1e-3, "klCoef": 0.01},
    )  # KL needs the frozen reference copy
    trainer = Trainer(cfg, redis_client, tiny_model_path)
    assert trainer.reference is not None
    trainer.start()
    xadd_samples(
        redis_client,
        [
            make_sample(i, PROMPT, [966, 446, 198 if i % 2 else 29856], [-10.8] * 3, 0.75 if i % 2 else -0.25)
            for i in range(8)
        ],
    )
    for _ in range(2):
        stats = trainer.train_on(trainer.collect())
        assert stats is not None
    assert stats["kl"] > 0  # the policy moved away from the reference
    assert trainer.publish() == 1
    v1 = trainer.store.path(1)
    assert {"config.json", "model.safetensors", "manifest.json"} <= {p.name for p in v1.iterdir()}
    assert trainer.store.manifest(1).kind == "full" and trainer.store.verify(1)
    # the tied LM head travels as the trained embeddings, checksummed; v0's copy of the base carries the base's
    assert LM_HEAD_FILE in trainer.store.manifest(1).files
    trained = trainer.engine.module.get_input_embeddings().weight.detach()
    assert torch.equal(load_file(str(v1 / LM_HEAD_FILE))[LM_HEAD_KEY], trained)
    path, problems = base_weights_path(trainer.store.root, str(tiny_model_path))
    assert (path, problems) == (str(trainer.store.root / BASE_DIR), [])
    base_embeddings = load_file(str(tiny_model_path / "model.safetensors"))["model.embed_tokens.weight"]
    assert torch.equal(load_file(str(Path(path) / LM_HEAD_FILE))[LM_HEAD_KEY], base_embeddings)
    assert not torch.equal(trained, base_embeddings)

    loaded = AutoModelForCausalLM.from_pretrained(v1, dtype=torch.float32).eval()
    ids = torch.tensor([[*PROMPT, 966, 446]])
    trainer.engine.module.eval()
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=ids).logits, trainer.engine.module(input_ids=ids).logits, atol=1e-5)
        base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
        assert not torch.allclose(base(input_ids=ids).logits, loaded(input_ids=ids).logits, atol=1e-4)

    resumed = Trainer(cfg, redis_client, tiny_model_path)
    assert (resumed.version, resumed.step) == (1, 2)
    a, b = trainer.engine.trainable_state_dict(), resumed.engine.trainable_state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
