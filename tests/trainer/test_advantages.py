"""Advantages (reward minus baseline, no critic), collation and staleness: pure functions, hand-checked."""

from __future__ import annotations

import pytest

from onlinerl.config import AlgorithmConfig
from onlinerl.schemas import TrainingSample
from onlinerl_trainer.advantages import (
    RunningBaseline,
    compute_advantages,
    keep_fraction,
    select_trainable,
    subsample_negatives,
)
from onlinerl_trainer.batching import StreamSample, collate, fit_to_length, staleness, staleness_action


def test_batch_and_no_baseline():
    assert compute_advantages([1.0, 0.0, 0.5], ["a"] * 3, baseline="batch") == pytest.approx([0.5, -0.5, 0.0])
    assert compute_advantages([0.75, -0.25], ["a"] * 2, baseline="none") == [0.75, -0.25]


def test_running_baseline_per_tenant_uses_value_before_the_batch():
    rb = RunningBaseline(momentum=0.5)
    # First batch: each unseen tenant starts at the prior (0: the reward of showing nothing), so a reject is
    # already below it.
    adv = compute_advantages([1.0, 0.0, -0.25], ["a", "a", "b"], baseline="running", running=rb)
    assert adv == pytest.approx([1.0, 0.0, -0.25])
    # Then halfway from the prior to the batch mean (a: 0.5, b: -0.25).
    assert rb.means == pytest.approx({"a": 0.25, "b": -0.125})
    # Second batch for a: baseline is the old 0.25, then it moves halfway to the batch mean 1.0.
    adv = compute_advantages([1.0], ["a"], baseline="running", running=rb)
    assert adv == pytest.approx([0.75])
    assert rb.means["a"] == pytest.approx(0.625)
    restored = RunningBaseline(0.5)
    restored.load_state_dict(rb.state_dict())
    assert restored.means == rb.means


def test_a_tenants_first_rejects_have_negative_advantage_under_a_prior():
    """The bug this guards: starting an unseen tenant at its own batch mean made a batch of rejects its own
    baseline (advantage 0, no gradient). The prior is the reward table's `empty` (Cursor: 0)."""
    rejects = [-0.25] * 4
    assert compute_advantages(rejects, ["t"] * 4, baseline="running", running=RunningBaseline(0.9)) == pytest.approx(
        [-0.25] * 4
    )
    prior = RunningBaseline(0.9, prior=0.1)  # a custom reward table whose `empty` is 0.1
    assert compute_advantages(rejects, ["t"] * 4, baseline="running", running=prior) == pytest.approx([-0.35] * 4)
    assert prior.means["t"] == pytest.approx(0.9 * 0.1 + 0.1 * -0.25)
    # A known tenant keeps its own mean, whatever the prior.
    assert compute_advantages([0.75], ["t"], baseline="running", running=prior) == pytest.approx([0.75 - 0.065])
    # prior=None: the old behaviour, kept for callers that ask for it (a first batch is its own baseline).
    legacy = RunningBaseline(0.9, prior=None)
    assert compute_advantages(rejects, ["t"] * 4, baseline="running", running=legacy) == pytest.approx([0.0] * 4)


def test_normalisation_divides_by_std():
    adv = compute_advantages([2.0, 0.0], ["a", "a"], baseline="none", normalize=True)
    assert adv == pytest.approx([2.0, 0.0], rel=1e-5)  # std 1, the baseline (none) is not re-centred
    adv = compute_advantages([3.0, 1.0], ["a", "a"], baseline="batch", normalize=True)
    assert adv == pytest.approx([1.0, -1.0], rel=1e-5)


def _sample(prompt, completion, lps, reward=1.0, version=0):
    return TrainingSample(
        event_id="e",
        rollout_id="r",
        tenant="t",
        policy_version=version,
        prompt_token_ids=prompt,
        completion_token_ids=completion,
        behaviour_logprobs=lps,
        reward=reward,
        accepted=True,
    )


def test_collate_left_pads_and_aligns_completion_targets():
    batch = collate(
        [
            StreamSample("1-0", _sample([5, 6, 7], [8, 9], [-0.1, -0.2])),
            StreamSample("2-0", _sample([5], [4], [-0.3], reward=-0.25)),
        ],
        max_len=16,
        pad_id=0,
    )
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9], [0, 0, 0, 5, 4]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [0, 0, 0, 1, 1]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 0, 0, 0, 1]]
    # target j predicts input j + 1: completions are the trailing targets of each row
    assert batch.completion_mask.tolist() == [[0, 0, 1, 1], [0, 0, 0, 1]]
    assert batch.targets[0, 2:4].tolist() == [8, 9]
    assert batch.behaviour_logp.tolist()[0] == pytest.approx([0, 0, -0.1, -0.2])
    assert batch.rewards.tolist() == [1.0, -0.25]
    assert batch.num_tokens == 3
    assert batch.completion_span == 2
    mb = batch.rows(1, 2)
    assert mb.input_ids.tolist() == [[5, 4]] and mb.completion_mask.tolist() == [[1]]


def test_fit_to_length_never_cuts_a_row():
    assert fit_to_length([1, 2, 3, 4], [5, 6], [-1, -2], 6) == ([1, 2, 3, 4], [5, 6], [-1, -2])  # exactly at the limit
    with pytest.raises(ValueError, match="exceeds max_len 5: never cut"):
        fit_to_length([1, 2, 3, 4], [5, 6], [-1, -2], 5)
    row = StreamSample(
        "1-0",
        TrainingSample(
            event_id="e",
            rollout_id="r",
            tenant="t",
            policy_version=0,
            prompt_token_ids=[1, 2, 3],
            completion_token_ids=[4],
            behaviour_logprobs=[-0.5],
            reward=1.0,
            accepted=True,
        ),
    )
    with pytest.raises(ValueError, match="never cut"):
        collate([row], max_len=3, pad_id=0)


def test_staleness_rule():
    assert staleness_action(staleness(5, 9), 4, "drop") == "keep"
    assert staleness_action(staleness(4, 9), 4, "drop") == "drop"
    assert staleness_action(staleness(4, 9), 4, "truncate") == "downweight"


def test_staleness_counts_versions_serving_moved_past_not_the_trainers_lead():
    # the trainer at v12 while the canary serves stable v3 (and any candidate): a v0 sample is 3 behind serving
    assert staleness(0, 12, oldest_served=3) == 3
    assert staleness_action(staleness(0, 12, oldest_served=3), 4, "drop") == "keep"
    # a sample of stable itself is fresh however far candidates and the trainer have moved
    assert staleness(3, 12, oldest_served=3) == 0
    # serving moved on to v9 (promoted): the same v0 sample is 9 behind and dropped
    assert staleness_action(staleness(0, 12, oldest_served=9), 4, "drop") == "drop"
    # a served version ahead of the trainer (a newer trainer took over) never makes a sample look staler
    assert staleness(5, 6, oldest_served=40) == 1
    # unknown table: the strict reading, the trainer's own version
    assert staleness(0, 12) == 12
    assert staleness(7, 5, oldest_served=3) == 0


def test_negative_subsampling_keeps_the_expected_gradient_and_every_non_negative_sample():
    ids = [f"{1700000000000 + i}-0" for i in range(20000)]
    adv = [0.9 if i % 10 == 0 else (0.0 if i % 10 == 1 else -0.07) for i in range(20000)]
    keep, weighted = subsample_negatives(ids, adv, 0.15)
    kept = set(keep)
    assert all(i in kept for i, a in enumerate(adv) if a >= 0)  # accepts and zeros: always
    negatives = sum(a < 0 for a in adv)
    kept_negatives = sum(adv[i] < 0 for i in keep)
    assert abs(kept_negatives / negatives - 0.15) < 0.01  # about the rate
    assert all(w == pytest.approx(-0.07 / 0.15) for i, w in zip(keep, weighted, strict=True) if adv[i] < 0)
    # unbiased: the sum of the weighted advantages matches the sum over every sample (to the sampling noise)
    assert sum(weighted) == pytest.approx(sum(adv), rel=0.05)
    # the same id gets the same decision (a redelivered sample), rate 1 keeps all, out-of-range rates are refused
    assert subsample_negatives(ids, adv, 0.15) == (keep, weighted) and 0.0 <= keep_fraction(ids[0]) < 1.0
    assert subsample_negatives(ids[:3], [-1.0, 0.5, -0.2], 1.0) == ([0, 1, 2], [-1.0, 0.5, -0.2])
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="negative sample rate"):
            subsample_negatives(ids[:1], [-1.0], bad)


def test_negative_weight_keeps_that_share_of_the_rejects_expected_gradient_and_leaves_accepts_alone():
    """weight = rate (the cpu profile): the same samples kept, each reject at its own advantage, so the rejects'
    summed push is the rate's share of the full one while every accept keeps its whole advantage."""
    ids = [f"{1700000000000 + i}-0" for i in range(20000)]
    adv = [0.9 if i % 10 == 0 else -0.07 for i in range(20000)]
    unbiased_keep, _ = subsample_negatives(ids, adv, 0.15)
    keep, weighted = subsample_negatives(ids, adv, 0.15, weight=0.15)
    assert keep == unbiased_keep  # the weight never changes which samples are trained
    assert all(w == pytest.approx(-0.07) for i, w in zip(keep, weighted, strict=True) if adv[i] < 0)
    assert all(w == 0.9 for i, w in zip(keep, weighted, strict=True) if adv[i] > 0)
    negatives = sum(w for w in weighted if w < 0)
    assert negatives == pytest.approx(0.15 * sum(a for a in adv if a < 0), rel=0.05)
    # rate 1 with a weight scales every reject by it; out-of-range weights are refused
    assert subsample_negatives(ids[:3], [-1.0, 0.5, -0.2], 1.0, weight=0.5) == ([0, 1, 2], [-0.5, 0.5, -0.1])
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="negative weight"):
            subsample_negatives(ids[:1], [-1.0], 0.5, weight=bad)


def test_select_trainable_accounts_for_every_sample_once():
    """The feed's rule, end to end on a batch: the baseline sees every reward, rejects are drawn and weighted,
    samples without gradient are set aside; every index lands in exactly one of train, subsampled, inert."""
    ids = [f"{1700000000000 + i}-0" for i in range(400)]
    rewards = [0.75 if i % 8 == 0 else -0.25 for i in range(400)]
    algo = AlgorithmConfig(negative_sample_rate=0.15, negative_weight=0.15)
    running = RunningBaseline(algo.baseline_momentum)
    chosen = select_trainable(ids, rewards, ["acme"] * 400, algo, running)
    assert sorted(chosen.train + chosen.subsampled + chosen.inert) == list(range(400))
    assert chosen.inert == []  # under the running baseline every reject is below it
    accepts = [i for i in range(400) if rewards[i] > 0]
    assert set(accepts) <= set(chosen.train) and all(
        a == 0.75 for i, a in zip(chosen.train, chosen.advantages, strict=True) if i in accepts
    )
    kept_rejects = [a for i, a in zip(chosen.train, chosen.advantages, strict=True) if rewards[i] < 0]
    assert 0.10 < len(kept_rejects) / 350 < 0.20 and all(a == pytest.approx(-0.25) for a in kept_rejects)
    assert running.means["acme"] == pytest.approx(0.1 * (sum(rewards) / 400))  # every reward seen, kept or not

    # run 6's reward with no baseline: a reject has advantage 0 and, with no KL, no gradient
    algo = AlgorithmConfig(baseline="none", kl_coef=0.0, negative_sample_rate=0.15, negative_weight=0.15)
    chosen = select_trainable(ids[:4], [1.0, 0.0, 0.0, 1.0], ["acme"] * 4, algo, None)
    assert (chosen.train, chosen.advantages, chosen.inert, chosen.subsampled) == ([0, 3], [1.0, 1.0], [1, 2], [])
    # the same zeros under a KL penalty are trained: the KL term has a gradient
    chosen = select_trainable(
        ids[:4], [1.0, 0.0, 0.0, 1.0], ["acme"] * 4, algo.model_copy(update={"kl_coef": 0.1}), None
    )
    assert chosen.train == [0, 1, 2, 3] and chosen.inert == []
