"""What bounds one update, per profile, under the default ``oldLogprobs: recompute``.

pi_old is the trainer's weights before the update, so in the first epoch the ratio pi_theta / pi_old is exactly 1 on
every token: the clip, the asymmetric clip and the dual clip cannot act. With the code default ``ppoEpochs: 1`` (the
GPU path) nothing but the optimizer bounds the update: one AdamW step moves each parameter by at most the learning
rate (``maxGradNorm`` rescales the gradient, which Adam's normalisation then divides out), and a token's probability
may move past 1 + clipEps in that one step. From the second epoch (the cpu profile runs 4) the ratio has moved and
the clip removes the gradient of tokens already past their bound; each epoch is one more step of at most the learning
rate. Measured through the real trainer on 8 accepts, on-policy; a large learning rate (1e-2) makes the moves
visible on the tiny model (the relations hold at any rate).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from onlinerl.config import AlgorithmConfig
from onlinerl.profiles import CPU_PROFILE
from onlinerl_trainer.trainer import Trainer

from .conftest import make_sample, trainer_config, xadd_samples
from .test_learning import logprobs_now

PROMPT = "def area(width, height):\n    return"
ACCEPTED = [" width * height\n", " height * width\n", " (width * height)\n", " width*height\n"]
LR = 1e-2
ADAM_SLACK = 1.01  # float error on AdamW's |step| <= lr (bias-corrected, early steps)


@pytest.fixture
def enc(tiny_model_path: Path):
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    return lambda s: tok.encode(s, add_special_tokens=False)


def _one_update(tmp_path, redis_client, valkey, tiny_model_path, enc, epochs: int):
    """One default-algorithm update of ``epochs`` epochs on 8 on-policy accepts. Returns the step's statistics, the
    largest change of any trainable parameter, and the largest realized token ratio pi_new / pi_old."""
    redis_client.flushdb()
    algo = AlgorithmConfig().model_dump(by_alias=True, exclude={"staleness"}) | {
        "ppoEpochs": epochs,
        "learningRate": LR,
    }
    cfg = trainer_config(tmp_path, valkey.url, tiny_model_path, checkpoint={"everySteps": 100}, algorithm=algo)
    assert cfg.trainer.algorithm.old_logprobs == "recompute"
    trainer = Trainer(cfg, redis_client, tiny_model_path)
    trainer.start()
    rows = [(enc(PROMPT), enc(ACCEPTED[i % len(ACCEPTED)])) for i in range(cfg.trainer.batch_size)]
    before = logprobs_now(trainer, rows)
    weights = trainer.engine.trainable_state_dict()
    xadd_samples(
        redis_client,
        [
            make_sample(i, p, c, lp, 0.75, trainer.version)
            for i, ((p, c), lp) in enumerate(zip(rows, before, strict=True))
        ],
    )
    stats = trainer.train_on(trainer.collect())
    assert stats is not None
    after = logprobs_now(trainer, rows)
    moved = trainer.engine.trainable_state_dict()
    step = max(float((moved[k] - weights[k]).abs().max()) for k in weights)
    ratio = max(math.exp(a - b) for new, old in zip(after, before, strict=True) for a, b in zip(new, old, strict=True))
    return stats, step, ratio


def test_one_epoch_the_clip_never_acts_and_adam_bounds_the_step(tmp_path, redis_client, valkey, tiny_model_path, enc):
    assert AlgorithmConfig().ppo_epochs == 1  # the code default (GPU)
    stats, step, ratio = _one_update(tmp_path, redis_client, valkey, tiny_model_path, enc, 1)
    print(
        f"1 epoch: clip {stats['clip_fraction']}, ratio in the loss <= {stats['ratio_max']:.6f}, max |dtheta| = "
        f"{step / LR:.4f} lr, realized token ratio up to {ratio:.3f}"
    )
    assert stats["clip_fraction"] == 0.0 and stats["dual_clip_fraction"] == 0.0
    assert stats["ratio_max"] == pytest.approx(1.0, abs=1e-5)  # the only epoch saw r = 1
    assert step <= LR * ADAM_SLACK  # the bound: one AdamW step
    assert ratio > 1.0 + AlgorithmConfig().clip_eps  # and the clip's 1 + eps did not hold: nothing clipped it


@pytest.mark.parametrize("epochs", [2, CPU_PROFILE["trainer.algorithm.ppoEpochs"]])
def test_more_epochs_the_clip_acts_from_the_second(tmp_path, redis_client, valkey, tiny_model_path, enc, epochs):
    stats, step, ratio = _one_update(tmp_path, redis_client, valkey, tiny_model_path, enc, epochs)
    # the statistics are token-weighted means over the epochs, and the first epoch clips nothing
    later = stats["clip_fraction"] * epochs / (epochs - 1)
    print(
        f"{epochs} epochs: clip fraction {stats['clip_fraction']:.3f} (epochs 2+: {later:.3f}), max |dtheta| = "
        f"{step / LR:.4f} lr, realized token ratio up to {ratio:.3f}"
    )
    assert 0.0 < later <= 1.0
    assert stats["ratio_max"] > 1.0 + AlgorithmConfig().clip_eps  # a later epoch saw a ratio past the clip
    assert step <= epochs * LR * ADAM_SLACK  # one AdamW step per epoch
