"""Under the default algorithm the PPO clip is taken against the trainer's own weights, not the served policy.

A canary serves most users from a version several behind the trainer's (run 17: a median of 5). Clipped against
the served policy mu, such a sample's ratio pi_theta / mu starts far from 1 before any update, and the clip removes
its gradient: the stale accept teaches nothing. The default (``oldLogprobs: recompute``, decoupled PPO) clips
pi_theta / pi_old, with pi_old the trainer's weights before the update, and corrects for sampling from mu with the
capped importance weight min(pi_old / mu, isTruncation). Here every token of a batch of accepts was served with a
third of the probability the trainer now gives it (pi_old / mu = 3), through the real trainer and stream.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from onlinerl.config import AlgorithmConfig, RewardConfig
from onlinerl_trainer.trainer import Trainer

from .conftest import make_sample, trainer_config, xadd_samples
from .test_learning import logprobs_now

PROMPT = "def area(width, height):\n    return"
ACCEPTED = [" width * height\n", " height * width\n", " (width * height)\n", " width*height\n"]
MISMATCH = math.log(3.0)  # log pi_old - log mu on every token


@pytest.fixture
def enc(tiny_model_path: Path):
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    return lambda s: tok.encode(s, add_special_tokens=False)


def _one_step_on_mismatched_accepts(tmp_path, redis_client, empty_valkey, tiny_model_path, enc, **algorithm):
    """One default trainer step on 8 accepts whose recorded log-probs are MISMATCH below the trainer's.
    Returns the step's statistics and the summed log-prob of each completion before and after it."""
    redis_client.flushdb()
    algo = AlgorithmConfig().model_dump(by_alias=True, exclude={"staleness"}) | algorithm
    cfg = trainer_config(tmp_path, empty_valkey.url, tiny_model_path, checkpoint={"everySteps": 100}, algorithm=algo)
    trainer = Trainer(cfg, redis_client, tiny_model_path)
    trainer.start()
    rows = [(enc(PROMPT), enc(ACCEPTED[i % len(ACCEPTED)])) for i in range(cfg.trainer.batch_size)]
    before = logprobs_now(trainer, rows)
    served = [[lp - MISMATCH for lp in lps] for lps in before]  # mu(a) = pi_old(a) / 3
    accept = RewardConfig().accepted
    xadd_samples(
        redis_client,
        [
            make_sample(i, p, c, lp, accept, trainer.version)
            for i, ((p, c), lp) in enumerate(zip(rows, served, strict=True))
        ],
    )
    stats = trainer.train_on(trainer.collect())
    assert stats is not None
    after = logprobs_now(trainer, rows)
    return stats, [sum(x) for x in before], [sum(x) for x in after]


def test_the_default_clips_against_the_trainers_weights(tmp_path, redis_client, empty_valkey, tiny_model_path, enc):
    assert AlgorithmConfig().old_logprobs == "recompute"
    stats, before, after = _one_step_on_mismatched_accepts(tmp_path, redis_client, empty_valkey, tiny_model_path, enc)
    assert AlgorithmConfig().ppo_epochs == 1  # one epoch: the ratio is pi_theta / pi_old = 1 on every token
    assert stats["clip_fraction"] == 0.0, stats
    assert stats["is_weight_mean"] == pytest.approx(AlgorithmConfig().is_truncation, rel=1e-4), stats  # min(3, 2)
    assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)  # every accept became likelier


def test_clipped_against_the_served_policy_a_stale_accept_teaches_nothing(
    tmp_path, redis_client, empty_valkey, tiny_model_path, enc
):
    """The same batch under ``oldLogprobs: behaviour``: ratio 3 > 1 + clipEps on every token, all of it clipped."""
    stats, before, after = _one_step_on_mismatched_accepts(
        tmp_path, redis_client, empty_valkey, tiny_model_path, enc, oldLogprobs="behaviour"
    )
    assert stats["clip_fraction"] == 1.0, stats
    assert after == pytest.approx(before, abs=1e-6)
