"""A reject teaches: under the product's default reward and algorithm, one trainer step on a rejected completion
lowers that completion's log-prob.

Nothing here is tuned for the test: the reward values come from ``RewardConfig()`` and the algorithm (baseline,
learning rate, clipping, epochs, KL) from ``AlgorithmConfig()``. The tenant's first batch carries the traffic's
usual mix (one accept in eight), so the running baseline starts where production would have it; the next batch holds
only rejects of one completion, and that completion must become less likely.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from onlinerl.config import AlgorithmConfig, RewardConfig
from onlinerl_trainer.trainer import Trainer

from .conftest import make_sample, trainer_config, xadd_samples
from .test_learning import logprobs_now

PROMPT = "def area(width, height):\n    return"
REJECTED = " width + height\n"  # a wrong body: the simulated user rejects it
OTHERS = [" width * height\n", " height * width\n", " (width * height)\n", " width*height\n"]
UNRELATED_PROMPT = "class Stack:\n    def push(self, item):\n       "
UNRELATED = " self.items.append(item)\n"


def _product_algorithm() -> dict:
    """The default algorithm section, camelCase as a config file would spell it (overrides conftest's test lr)."""
    return AlgorithmConfig().model_dump(by_alias=True, exclude={"staleness"})


@pytest.fixture
def enc(tiny_model_path: Path):
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    return lambda s: tok.encode(s, add_special_tokens=False)


def _after_a_production_mix(tmp_path, redis_client, empty_valkey, tiny_model_path, enc, second: list[tuple[str, str]]):
    """A trainer on the product's defaults takes the tenant's first batch (one accept in eight, as real traffic
    mixes them), then one step on rejects of ``second`` (prompt, completion pairs). Returns log p(REJECTED | PROMPT)
    before and after that second step, the step's statistics and the trainer."""
    redis_client.flushdb()
    reward = RewardConfig()
    cfg = trainer_config(
        tmp_path, empty_valkey.url, tiny_model_path, checkpoint={"everySteps": 100}, algorithm=_product_algorithm()
    )
    assert cfg.trainer.algorithm.baseline == AlgorithmConfig().baseline
    assert cfg.trainer.algorithm.learning_rate == AlgorithmConfig().learning_rate
    trainer = Trainer(cfg, redis_client, tiny_model_path)
    trainer.start()
    prompt, rejected = enc(PROMPT), enc(REJECTED)

    warm_rows = [(prompt, enc(OTHERS[i % len(OTHERS)])) for i in range(8)]
    warm = [
        make_sample(i, p, c, lp, reward.accepted if i == 0 else reward.rejected, trainer.version)
        for i, ((p, c), lp) in enumerate(zip(warm_rows, logprobs_now(trainer, warm_rows), strict=True))
    ]
    xadd_samples(redis_client, warm)
    assert trainer.train_on(trainer.collect()) is not None

    (before,) = logprobs_now(trainer, [(prompt, rejected)])
    rows = [(enc(p), enc(c)) for p, c in second] * (cfg.trainer.batch_size // len(second))
    lps = logprobs_now(trainer, rows)
    xadd_samples(
        redis_client,
        [
            make_sample(100 + i, p, c, lp, reward.rejected, trainer.version)
            for i, ((p, c), lp) in enumerate(zip(rows, lps, strict=True))
        ],
    )
    stats = trainer.train_on(trainer.collect())
    assert stats is not None, "the rejects were dropped as inert: a reject carried no gradient"
    assert stats["advantage_mean"] < 0, f"a reject got advantage {stats['advantage_mean']} under the default baseline"
    (after,) = logprobs_now(trainer, [(prompt, rejected)])
    return sum(before), sum(after), stats, trainer


def test_one_step_on_a_reject_lowers_its_logprob(tmp_path, redis_client, empty_valkey, tiny_model_path, enc):
    """In the middle of training, a step moves the policy by Adam's momentum as well as by its own gradient: with the
    rejects at a fraction of their push (negativeWeight) the previous step's accept can outweigh them. What the
    reject itself does is measured against a twin: the same trainer state (same seed, same first batch) taking the
    same step on rejects of an unrelated completion. Rejecting REJECTED must leave it less likely than the twin's
    step does."""
    reward = RewardConfig()
    assert reward.rejected < 0 < reward.accepted  # the product's default reward penalises a reject
    twin_before, twin_after, _, _ = _after_a_production_mix(
        tmp_path / "twin", redis_client, empty_valkey, tiny_model_path, enc, [(UNRELATED_PROMPT, UNRELATED)]
    )
    before, after, stats, trainer = _after_a_production_mix(
        tmp_path / "reject", redis_client, empty_valkey, tiny_model_path, enc, [(PROMPT, REJECTED)]
    )
    assert before == pytest.approx(twin_before, abs=1e-5)  # the same state before the step: a fair twin
    own = (after - before) - (twin_after - twin_before)
    print(
        f"log p(rejected completion) {before:.5f} -> {after:.5f}; twin {twin_before:.5f} -> {twin_after:.5f}; "
        f"the reject's own move {own:+.2e} nats"
    )
    assert own < 0

    rendered = trainer.metrics.render().decode()
    assert "onlinerl_trainer_inert_samples_total 0.0" in rendered
    # every sample of the step carried a negative advantage, and the step says so
    assert stats["negative_advantage_share"] == 1.0
    assert 'onlinerl_trainer_negative_advantage_share{line="shared"} 1.0' in rendered
    assert stats["entropy_out_of_band"] in (0.0, 1.0)
    if AlgorithmConfig().kl_coef > 0:  # the KL to the adapter-off base is measured and positive once moved
        assert stats["kl"] >= 0.0


def test_a_tenants_first_batch_of_rejects_moves_the_policy(tmp_path, redis_client, empty_valkey, tiny_model_path, enc):
    reward = RewardConfig()
    cfg = trainer_config(tmp_path / "ckpt", empty_valkey.url, tiny_model_path, algorithm=_product_algorithm())
    trainer = Trainer(cfg, redis_client, tiny_model_path)
    trainer.start()
    prompt, rejected = enc(PROMPT), enc(REJECTED)
    (before,) = logprobs_now(trainer, [(prompt, rejected)])
    samples = [make_sample(i, prompt, rejected, before, reward.rejected, trainer.version) for i in range(8)]
    xadd_samples(redis_client, samples)
    stats = trainer.train_on(trainer.collect())
    # The unseen tenant starts at the prior (reward.empty), not at its own batch's mean: every reject is below it.
    assert stats is not None, "a tenant's first rejects were dropped as inert"
    algo = AlgorithmConfig()  # a reject carries negativeWeight / negativeSampleRate of its advantage (advantages.py)
    assert stats["advantage_mean"] == pytest.approx(
        (reward.rejected - reward.empty) * algo.negative_weight / algo.negative_sample_rate
    )
    assert "onlinerl_trainer_inert_samples_total 0.0" in trainer.metrics.render().decode()
    (after,) = logprobs_now(trainer, [(prompt, rejected)])
    assert sum(after) < sum(before)
