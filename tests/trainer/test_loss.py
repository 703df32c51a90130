"""The PPO loss against values computed by hand (eps = 0.2 unless said otherwise)."""

from __future__ import annotations

import math

import pytest
import torch

from onlinerl_trainer.loss import (
    kl_penalty,
    masked_aggregate,
    ppo_loss,
    tempered,
    token_entropy,
    token_logprobs,
    truncated_is_weight,
)


def one_token(ratio: float, adv: float, **kw):
    """A single completion token whose ratio pi/pi_old is ``ratio``; returns (loss, d loss / d logp, stats)."""
    logp = torch.tensor([[math.log(ratio)]], requires_grad=True)
    old = torch.tensor([[0.0]])
    out = ppo_loss(logp, old, torch.tensor([adv]), torch.ones(1, 1), **kw)
    out.loss.backward()
    return out.loss.item(), float(logp.grad[0, 0]), out.stats


@pytest.mark.parametrize(
    ("ratio", "adv", "loss", "grad", "clipped"),
    [
        # A > 0: the clip binds only above 1 + eps.
        (1.1, 1.0, -1.1, -1.1, 0.0),  # inside: -A r, gradient -A r
        (1.5, 1.0, -1.2, 0.0, 1.0),  # above: -A (1 + eps), no gradient
        (0.5, 1.0, -0.5, -0.5, 0.0),  # below: pessimistic bound is the unclipped -A r
        # A < 0: the clip binds only below 1 - eps.
        (0.9, -2.0, 1.8, 1.8, 0.0),  # inside: -A r = 1.8
        (0.5, -1.0, 0.8, 0.0, 1.0),  # below: -A (1 - eps) = 0.8, no gradient
        (1.5, -1.0, 1.5, 1.5, 0.0),  # above: unclipped 1.5 (this is what the dual clip bounds)
        (1.3, 0.0, 0.0, 0.0, 0.0),  # zero advantage: nothing to learn
    ],
)
def test_clipped_surrogate_by_hand(ratio, adv, loss, grad, clipped):
    got_loss, got_grad, stats = one_token(ratio, adv)
    assert got_loss == pytest.approx(loss, abs=1e-6)
    assert got_grad == pytest.approx(grad, abs=1e-6)
    assert stats["clip_fraction"] == clipped
    assert stats["ratio_mean"] == pytest.approx(ratio)


def test_dual_clip_bounds_negative_advantage_only():
    # A = -1, r = 5, c = 3: plain PPO loss is max(5, 1.2) = 5; dual clip caps it at c * |A| = 3, gradient 0.
    loss, grad, stats = one_token(5.0, -1.0, dual_clip=3.0)
    assert (loss, grad, stats["dual_clip_fraction"]) == (pytest.approx(3.0), 0.0, 1.0)
    # Below the bound it changes nothing: r = 2 -> 2, gradient -A r = 2.
    loss, grad, stats = one_token(2.0, -1.0, dual_clip=3.0)
    assert (loss, grad, stats["dual_clip_fraction"]) == (pytest.approx(2.0), pytest.approx(2.0), 0.0)
    # A > 0 is untouched by the dual clip: r = 5 -> -(1 + eps) = -1.2.
    loss, grad, _ = one_token(5.0, 1.0, dual_clip=3.0)
    assert (loss, grad) == (pytest.approx(-1.2), 0.0)
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        one_token(1.0, 1.0, dual_clip=0.5)


def test_mask_excludes_prompt_and_padding():
    # Tokens: [trained r=1.1, trained r=0.9, masked r=100]; A = 1 -> token-mean over 2 tokens: -(1.1 + 0.9) / 2 = -1.
    logp = torch.log(torch.tensor([[1.1, 0.9, 100.0]]))
    out = ppo_loss(logp, torch.zeros(1, 3), torch.tensor([1.0]), torch.tensor([[1.0, 1.0, 0.0]]))
    assert float(out.loss) == pytest.approx(-1.0)
    assert out.stats["ratio_max"] == pytest.approx(1.1)
    assert out.stats["tokens"] == 2


def test_token_mean_vs_seq_mean():
    # Seq 0: one token, ratio 1, A = 1 -> token loss -1.  Seq 1: three tokens, ratio 1, A = -1 -> +1 each.
    logp = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    adv = torch.tensor([1.0, -1.0])
    token = ppo_loss(logp, logp, adv, mask, aggregation="token-mean")
    seq = ppo_loss(logp, logp, adv, mask, aggregation="seq-mean")
    assert float(token.loss) == pytest.approx((-1 + 3) / 4)  # 0.5: the long completion dominates
    assert float(seq.loss) == pytest.approx((-1 + 1) / 2)  # 0.0: each completion weighs the same


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean"])
def test_normalizer_makes_micro_batches_add_up(aggregation):
    torch.manual_seed(0)
    logp, old = torch.randn(4, 5) * 0.1, torch.randn(4, 5) * 0.1
    mask = (torch.rand(4, 5) > 0.3).float()
    mask[:, 0] = 1
    adv = torch.randn(4)
    full = ppo_loss(logp, old, adv, mask, aggregation=aggregation)
    norm = float(mask.sum()) if aggregation == "token-mean" else 4.0
    parts = sum(
        float(
            ppo_loss(
                logp[i : i + 2],
                old[i : i + 2],
                adv[i : i + 2],
                mask[i : i + 2],
                aggregation=aggregation,
                normalizer=norm,
            ).loss
        )
        for i in (0, 2)
    )
    assert parts == pytest.approx(float(full.loss), abs=1e-6)


def test_kl_estimators_by_hand():
    logp, ref = torch.log(torch.tensor([[0.5]])), torch.log(torch.tensor([[0.25]]))
    # k3 = ref/pi - log(ref/pi) - 1 = 0.5 + ln 2 - 1 ; k1 = log pi - log ref = ln 2
    assert float(kl_penalty(logp, ref, "k3")) == pytest.approx(0.5 + math.log(2) - 1)
    assert float(kl_penalty(logp, ref, "k1")) == pytest.approx(math.log(2))
    assert float(kl_penalty(ref, ref, "k3")) == 0.0
    # In the loss: ratio 1, A = 0 -> only kl_coef * k3 remains.
    out = ppo_loss(logp, logp, torch.tensor([0.0]), torch.ones(1, 1), ref_logp=ref, kl_coef=0.1)
    assert float(out.loss) == pytest.approx(0.1 * (0.5 + math.log(2) - 1))
    assert out.stats["kl"] == pytest.approx(0.5 + math.log(2) - 1)


def test_entropy_bonus_and_entropy():
    logits = torch.zeros(1, 1, 4)  # uniform over 4 tokens
    ent = token_entropy(logits)
    assert float(ent) == pytest.approx(math.log(4))
    out = ppo_loss(
        torch.zeros(1, 1), torch.zeros(1, 1), torch.tensor([0.0]), torch.ones(1, 1), entropy=ent, entropy_coef=0.01
    )
    assert float(out.loss) == pytest.approx(-0.01 * math.log(4))


def test_truncated_importance_weight():
    old, behaviour = torch.log(torch.tensor([[0.9, 0.3]])), torch.log(torch.tensor([[0.3, 0.6]]))
    w = truncated_is_weight(old, behaviour, cap=2.0)  # ratios 3 (capped to 2) and 0.5
    assert w.tolist()[0] == pytest.approx([2.0, 0.5])
    # In the loss it scales the surrogate: ratio 1, A = 1 -> -(2 + 0.5) / 2
    out = ppo_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2), is_weight=w)
    assert float(out.loss) == pytest.approx(-1.25)


def test_token_logprobs_and_approx_kl():
    logits = torch.tensor([[[0.0, 0.0, 0.0], [math.log(3.0), 0.0, 0.0]]])  # [1, 2, 3]
    lp = token_logprobs(logits, torch.tensor([[1, 0]]))
    assert lp.tolist()[0] == pytest.approx([math.log(1 / 3), math.log(3 / 5)])
    # approx_kl is k3 of (old || new): ratio 2 -> (2 - 1) - ln 2
    _, _, stats = one_token(2.0, 1.0)
    assert stats["approx_kl"] == pytest.approx(1 - math.log(2))


def test_tempered_logprobs_are_per_row_and_match_log_softmax():
    torch.manual_seed(0)
    logits = torch.randn(3, 4, 11) * 3  # [B, T, V]
    targets = torch.randint(0, 11, (3, 4))
    temps = torch.tensor([1.0, 0.7, 0.01])
    lp = token_logprobs(tempered(logits, temps), targets)
    for i, t in enumerate(temps.tolist()):
        want = torch.log_softmax(logits[i] / t, -1).gather(-1, targets[i].unsqueeze(-1)).squeeze(-1)
        assert torch.allclose(lp[i], want, atol=1e-6)
    greedy = logits.argmax(-1)  # at T = 0.01 the argmax token has mu ~ 1 (these logits have gaps >> 0.01)
    assert float(token_logprobs(tempered(logits, temps), greedy)[2].min()) > -1e-3
    assert torch.equal(tempered(logits, None), logits) and torch.equal(tempered(logits, 1.0), logits)
    assert torch.allclose(tempered(logits, 0.5), logits * 2)
    # the untempered evaluation of a T = 0.01 sample is not mu: the ratio would be far from 1 on-policy
    assert float(token_logprobs(logits, greedy)[2].min()) < -1e-2


def test_masked_aggregate_rejects_unknown_mode():
    with pytest.raises(ValueError, match="token-mean"):
        masked_aggregate(torch.zeros(1, 1), torch.ones(1, 1), "sum")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("ratio", "adv", "loss", "grad", "clipped"),
    [
        # A < 0 with eps_neg = 0.1: the lower bound moves up to 0.9 ...
        (0.85, -1.0, 0.9, 0.0, 1.0),  # below 0.9: -A (1 - eps_neg), no gradient (plain eps = 0.2 would still push)
        (0.95, -1.0, 0.95, 0.95, 0.0),  # inside: -A r
        (1.5, -1.0, 1.5, 1.5, 0.0),  # above: unclipped, as without the asymmetry
        # ... and A > 0 keeps eps = 0.2 on both sides.
        (1.15, 1.0, -1.15, -1.15, 0.0),
        (1.5, 1.0, -1.2, 0.0, 1.0),
        (0.85, 1.0, -0.85, -0.85, 0.0),
    ],
)
def test_asymmetric_clip_for_negative_advantages(ratio, adv, loss, grad, clipped):
    got_loss, got_grad, stats = one_token(ratio, adv, clip_eps_negative=0.1)
    assert got_loss == pytest.approx(loss, abs=1e-6)
    assert got_grad == pytest.approx(grad, abs=1e-6)
    assert stats["clip_fraction"] == clipped


def test_asymmetric_clip_mixes_per_sequence_and_rejects_out_of_range():
    # Two sequences at ratio 0.85: the rejected one (A < 0) is clipped at 0.9, the accepted one (A > 0) is not.
    logp = torch.full((2, 1), math.log(0.85), requires_grad=True)
    out = ppo_loss(logp, torch.zeros(2, 1), torch.tensor([-1.0, 1.0]), torch.ones(2, 1), clip_eps_negative=0.1)
    out.loss.backward()
    assert float(out.loss.detach()) == pytest.approx((0.9 - 0.85) / 2)  # token-mean of 0.9 and -0.85
    assert logp.grad[:, 0].tolist() == pytest.approx([0.0, -0.85 / 2])
    assert out.stats["clip_fraction"] == pytest.approx(0.5)
    for bad in (0.0, 1.0, -0.1):
        with pytest.raises(ValueError, match="clip_eps_negative must be in"):
            one_token(1.0, -1.0, clip_eps_negative=bad)


def test_k3_penalty_pulls_a_pushed_down_token_back_to_the_base():
    # pi = 0.25 after rejects pushed it below the base's 0.5: d k3 / d logp = 1 - pi_ref / pi = 1 - 2 = -1, so
    # descending the loss raises logp again; k1 would give +1 (push further down) and is the biased one here.
    for estimator, want in (("k3", -1.0), ("k1", 1.0)):
        logp = torch.log(torch.tensor([[0.25]])).requires_grad_(True)
        ref = torch.log(torch.tensor([[0.5]]))
        out = ppo_loss(
            logp, logp.detach(), torch.tensor([0.0]), torch.ones(1, 1), ref_logp=ref, kl_coef=1.0,
            kl_estimator=estimator,
        )  # fmt: skip
        out.loss.backward()
        assert float(logp.grad) == pytest.approx(want)
