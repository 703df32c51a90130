"""Silence never teaches the policy to write what nobody saw.

A silence sample is a tracked rollout nobody rated in time ("not shown", ``feedback.silence``, off by default): the
feedback service appends it with ``reward.empty`` (0) and the whole generated completion. Under the product's reward
most outcomes are rejects, so the tenant's running baseline is negative and 0 - baseline > 0: such a sample used to
push its completion up, token by token (issue 35). Now a silence sample's advantage is capped at 0
(advantages.cap_unseen): with a negative baseline it is inert, with a positive one (a tenant that accepts a lot) it
pushes the unseen completion down, never up. Measured with the real trainer on the product's default algorithm,
as tests/trainer/test_reject_gradient.py does for rejects.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from onlinerl.config import AlgorithmConfig, RewardConfig
from onlinerl.schemas import SILENCE_MATCH
from onlinerl_trainer.advantages import RunningBaseline, select_trainable
from onlinerl_trainer.trainer import Trainer

from .conftest import make_sample, trainer_config, xadd_samples
from .test_learning import logprobs_now

PROMPT = "def area(width, height):\n    return"
SHOWN = [" width * height\n", " height * width\n", " (width * height)\n", " width*height\n"]
UNSEEN = " 0\n"  # what the policy generated and the client never showed
UNRELATED_PROMPT = "class Stack:\n    def push(self, item):\n       "
UNRELATED = " self.items.append(item)\n"


@pytest.fixture
def enc(tiny_model_path: Path):
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    return lambda s: tok.encode(s, add_special_tokens=False)


def _product_algorithm() -> dict:
    return AlgorithmConfig().model_dump(by_alias=True, exclude={"staleness"})


def _silence_after(tmp_path, redis_client, valkey, tiny_model_path, enc, first_reward: float, silent=None):
    """A default trainer takes a tenant's batch of shown outcomes (all at ``first_reward``), then a batch of silence
    samples of ``silent`` (prompt, completion; default PROMPT, UNSEEN). Returns (log p(UNSEEN | PROMPT) before and
    after the silence step, its statistics or None, the trainer)."""
    redis_client.flushdb()
    reward = RewardConfig()
    cfg = trainer_config(tmp_path, valkey.url, tiny_model_path, algorithm=_product_algorithm())
    trainer = Trainer(cfg, redis_client, tiny_model_path)
    trainer.start()
    prompt = enc(PROMPT)
    rows = [(prompt, enc(SHOWN[i % len(SHOWN)])) for i in range(8)]
    first = [
        make_sample(i, p, c, lp, first_reward, trainer.version)
        for i, ((p, c), lp) in enumerate(zip(rows, logprobs_now(trainer, rows), strict=True))
    ]
    xadd_samples(redis_client, first)
    assert trainer.train_on(trainer.collect()) is not None

    unseen = enc(UNSEEN)
    (before,) = logprobs_now(trainer, [(prompt, unseen)])
    s_prompt, s_completion = (prompt, unseen) if silent is None else (enc(silent[0]), enc(silent[1]))
    (s_logprobs,) = logprobs_now(trainer, [(s_prompt, s_completion)])
    silences = [
        make_sample(200 + i, s_prompt, s_completion, s_logprobs, reward.empty, trainer.version).model_copy(
            update={"match": SILENCE_MATCH, "shown_text": ""}
        )
        for i in range(8)
    ]
    xadd_samples(redis_client, silences)
    stats = trainer.train_on(trainer.collect())
    (after,) = logprobs_now(trainer, [(prompt, unseen)])
    return sum(before), sum(after), stats, trainer


def test_after_rejects_silence_does_not_raise_the_unseen_completion(
    tmp_path, redis_client, valkey, tiny_model_path, enc
):
    """The issue's case: the baseline is below ``empty`` after rejects; silence used to get a positive advantage."""
    reward = RewardConfig()
    assert reward.rejected < reward.empty  # the product's table: the premise of the attack
    before, after, stats, trainer = _silence_after(
        tmp_path, redis_client, valkey, tiny_model_path, enc, reward.rejected
    )
    assert trainer.feed.baseline.means["acme"] < reward.empty
    assert stats is None, f"silence samples were trained: {stats}"  # inert: acknowledged without a pass
    assert after == pytest.approx(before, abs=1e-6), (before, after)  # not one token moved up
    assert "onlinerl_trainer_inert_samples_total 8.0" in trainer.metrics.render().decode()


def test_after_accepts_silence_lowers_the_unseen_completion(tmp_path, redis_client, valkey, tiny_model_path, enc):
    """A tenant whose baseline sits above ``empty``: a suggestion not shown was worth less than the average outcome,
    and silence pushes it down (the one direction a capped advantage allows). The step also carries Adam's momentum
    from the accepts before it, so the silence's own move is measured against a twin (same state, same step on
    silences of an unrelated completion), as tests/trainer/test_reject_gradient.py does."""
    reward = RewardConfig()
    accept = reward.accepted + reward.accepted_per_char * 10
    twin_before, twin_after, _, _ = _silence_after(
        tmp_path / "twin", redis_client, valkey, tiny_model_path, enc, accept, (UNRELATED_PROMPT, UNRELATED)
    )
    before, after, stats, trainer = _silence_after(tmp_path / "own", redis_client, valkey, tiny_model_path, enc, accept)
    assert before == pytest.approx(twin_before, abs=1e-5)  # a fair twin
    assert trainer.feed.baseline.means["acme"] > reward.empty
    assert stats is not None and stats["advantage_mean"] < 0, stats
    own = (after - before) - (twin_after - twin_before)
    print(f"log p(unseen) {before:.5f} -> {after:.5f}; twin {twin_before:.5f} -> {twin_after:.5f}; own {own:+.2e}")
    assert own < 0


def test_the_cap_is_the_feeds_rule_and_the_baseline_still_sees_silence():
    """The same rule the feed runs, on numbers: silence capped at 0, a shown outcome at the same reward not; the
    baseline moves with the silence reward all the same."""
    algo = AlgorithmConfig()
    running = RunningBaseline(algo.baseline_momentum)
    running.means["t"] = -0.2
    chosen = select_trainable(["a", "b"], [0.0, 0.0], ["t", "t"], algo, running, unseen=[True, False])
    assert chosen.inert == [0] and chosen.train == [1]
    assert chosen.advantages == [pytest.approx(0.2)]
    assert running.means["t"] == pytest.approx(0.9 * -0.2)
