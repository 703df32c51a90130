"""Critic-free clipped PPO loss, written out plainly. Pure functions of tensors: no model, no config, no I/O.

Notation (per completion token t of sequence i; shapes in brackets, B = sequences, T = token positions):
    logp      [B, T]  log pi_theta(a_t | s_t)        the policy being trained (carries the gradient)
    old_logp  [B, T]  log pi_old(a_t | s_t)          the policy the ratio is taken against (recomputed by default)
    ref_logp  [B, T]  log pi_ref(a_t | s_t)          the reference policy for the KL penalty (LoRA: adapter disabled)
    adv       [B]     A_i = R_i - b                  one advantage per sequence (one-step episode), per token
    mask      [B, T]  1 for a trained completion token, 0 for prompt / padding
    is_weight [B, T]  truncated importance weight min(pi_old / mu, cap) correcting old -> behaviour mismatch (detached)

    ratio r    = exp(logp - old_logp)
    surrogate  = max(-A * r, -A * clip(r, 1 - eps_A, 1 + eps))          (PPO, Schulman et al. 2017, as a loss)
    eps_A      = eps_neg where A < 0, else eps                           (asymmetric clip: for A < 0 only the lower
                                                                          bound binds, so eps_neg < eps caps how far
                                                                          one batch of rejects can push a token down)
    dual clip  = min(surrogate, -c * A)   only where A < 0              (Ye et al. 2020, c > 1: bounds the loss when
                                                                          r >> 1 on a negative advantage)
    kl (k3)    = exp(ref - logp) - (ref - logp) - 1                     (Schulman's unbiased, non-negative estimator
    kl (k1)    = logp - ref                                              of KL(pi_theta || pi_ref); k1 the naive one)
    token loss = is_weight * dual_clipped_surrogate + kl_coef * kl - entropy_coef * entropy

Aggregation over the masked tokens:
    token-mean: sum(token_loss * mask) / sum(mask)                      every token weighs the same (long completions
                                                                          weigh more)
    seq-mean:   mean_i( sum_t(token_loss * mask) / sum_t(mask) )        every completion weighs the same

Behaviour distribution and temperature (per sequence i; z = the model's logits at a position):
    T_i       the temperature vLLM sampled sequence i at: TrainingSample.temperature, copied from
              RolloutRecord.sampling.temperature, the value the gateway sent (after the exploration floor)
    mu        = softmax(z_served / T_i): the behaviour policy, the served weights tempered. vLLM runs with
              --logprobs-mode processed_logprobs, so behaviour_logp is log mu(a_t), not log softmax(z_served)(a_t).
              The gateway refuses top_p/top_k/min_p/penalties/logit_bias (400): nothing else reshapes mu.
    pi_theta  = softmax(z_theta / T_i), per row (:func:`tempered`); so are pi_old when recomputed, pi_ref for the KL,
              and the entropy. What is trained is the policy as it is sampled.
    On-policy (z_theta = z_served, first epoch): logp = log mu up to float error, so r = exp(logp - old_logp) = 1
    and the IS weight pi_old / mu = 1. Evaluated untempered, r = softmax(z)(a) / softmax(z / T)(a) != 1 before any
    update: at T = 0.01 the greedy token has mu ~ 1 but softmax(z)(a) is, say, 0.3, a spurious ratio the clip eats.
    Gradient: d log softmax(z / T)(a) / dz = (onehot(a) - pi_T) / T. At a low T a sampled greedy token has pi_T ~ 1
    and carries almost no gradient (the policy is already sure of it); the exploration floor (T >=
    explorationTemperature, default 0.7) keeps pi_T spread, so rated alternatives move the logits, scaled by 1 / T.
    The update changes z, hence the policy at every temperature; the objective is the reward of what users were
    served at their T_i. Below 1e-5 vLLM samples greedily (mu a point mass) and still reports T = 1 log-probs: no
    T matches that, so such rollouts (recorded as temperature 0) are audited by the feedback service, never trained.

The default (AlgorithmConfig; measurements and reasoning in docs/demo.md, "Choosing the default algorithm" and
"Offline screen"):
    With the default reward (an accept 0.5 + 0.0125 min(n, 40) for n shown characters, a reject -0.25, silence 0;
    Cursor's flat +0.75 is the n = 20 point) about 92% of samples are rejects with A < 0. Pushing a sampled
    (usually modal) token down hands its mass to every other token, so unbounded it flattens the policy: run 4,
    entropy 1.05 -> 2.33 in 24 steps, accept rate to 0. What the rejects add, on shown suggestions: the reward is
    the 1/0 reward, each accept weighted by its length (g(n) = 0.75 + 0.0125 min(n, 40), 0.8 at 4 characters,
    1.25 at a line), minus 0.25; the running baseline is the running mean of it, so A = 1{accepted} g(n) - p_hat
    (p_hat: the tenant's running mean of 1{accepted} g, ~0.05). For any constant baseline
    E[(R - b) grad log pi] = E[1{accepted} g grad log pi]: the rejects' expected push is the zero-mean score term
    -p_hat E[grad log pi], all variance, while the few accepts carry the direction, and g tilts it from "stop
    after the sure part" toward "finish the line" (under Cursor's flat table g = 1 and the policy halved its
    suggestions, run 16). Silence samples (reward 0, between the two; feedback.silence, off by default) would make the
    table another objective and pushed up text nobody saw; their advantage is capped at 0 (advantages.cap_unseen),
    so they only ever push down. Four bounds, each cheap, keep the reject's gradient without letting it drown the
    accepts:
    - negative weight w = 0.05 (advantages.subsample_negatives, before this loss): a reject carries w of its
      advantage in expectation, A_reject = -w p_hat. That is 1{accepted} scaled by c = 1 - (1 - w) p_hat minus a
      constant baseline w p_hat: the same expected direction, less variance. Where trainer passes are scarce (the
      cpu profile) a reject is trained with probability rate = 0.05 and A scaled by w / rate, so a kept reject
      carries its own A (-0.05); weight 1 would multiply it by 1/rate. On the same 2,010 recorded samples (the
      offline screen) weight 1 moved nothing held-out (KL on or off); weight 0.15 without the KL moved the way the
      accepts alone did, about half as far (shown length -4.3 characters against -8.6; accepts 4 gained / 2 lost);
      weight 0.05 as far as 0.15 in a third of the updates, and live (run 16) further than 0.15 (run 15);
    - eps_neg 0.1 < eps 0.2: a reject's gradient stops once its token is 10% below mu (0.8 would allow 20%);
    - dual clip c = 3: a stale token whose ratio grew large (r >> 1) cannot make a reject's loss unbounded;
    - seq-mean: a rejected 3-line completion (32 tokens) weighs as much as an accepted 5-token one; with token-mean
      the long rejects dominate the batch gradient and the net push is downward even when sum_i A_i = 0.
    The ratio is taken against pi_old = the trainer's weights before the update (old_logprobs recompute: one no-grad
    forward per batch; decoupled PPO, Hilton et al. 2021), and mu enters only as is_weight = min(pi_old / mu, 2).
    Under the canary most samples are served by stable, a median of 5-6 versions behind the trainer: against mu a
    ratio starts away from 1 before any update and the clip removes what a stale accept teaches (run 17, behaviour:
    clip fraction median 0.077, four times run 16's under direct). Recomputed, the first epoch starts at r = 1 (run
    18: clip fraction median 0.007 over 4 epochs) and the held-out bar was met on both corpora (docs/demo.md, run 18).

What bounds one update (tests/trainer/test_ppo_epochs_bound.py). pi_old is recomputed once per batch, before its
first epoch, with the very weights being trained, so in epoch 1 r = 1 on every token: clipped = unclipped, and
neither clip (eps, eps_neg) nor the dual clip can act. The bounds above are therefore bounds of epochs 2 and later.
    - ppo_epochs 1 (the code default, the GPU path): the clips never act. The bound is the optimizer's: one AdamW step
      moves each parameter by at most learning_rate (1e-4; the first step by exactly lr x sign of the gradient),
      whatever the advantages' scale (max_grad_norm rescales the gradient, and Adam's normalisation divides the scale
      out). A token's probability may move past 1 + eps in that step (measured: 1.58x at lr 1e-2 on the tiny model,
      clip fraction 0). What else bounds it: is_weight <= is_truncation (a stale sample's weight), negative_weight
      (the rejects' share), seq-mean, and the canary's gate and statistics after the version is published.
    - ppo_epochs 4 (the cpu profile, lr 2e-4): epoch 1 as above; from epoch 2 the ratio has moved and a token past
      its bound in the advantage's direction loses its gradient (clip fraction 0.72 of the later epochs' tokens at lr
      1e-2 on the tiny model; run 18 at lr 2e-4: median 0.007 over all 4 epochs). Each epoch is one more AdamW step,
      so a parameter moves by at most 4 x lr per update. The clip is per token, not a bound on the policy: shared
      (LoRA) weights still move for the tokens not clipped, so a clipped token's ratio can keep growing (2.1x after 4
      epochs in the same measurement).
    The KL penalty is available and off (kl_coef 0): k3 on the sampled tokens, pi_ref = the LoRA adapter switched
    off (the base, not the previous version), one no-grad forward per batch, [B, T] floats kept across epochs;
    d k3 / d logp = 1 - pi_ref / pi_theta pulls a moved token back. At 0.1 with the rejects at weight 0.15 it held
    the policy at the base (screen W: nothing moved; the same without the KL learned). An exact KL over the
    vocabulary would also see mass moving to junk tokens, but needs the base's [B, T, V] distribution across epochs
    (50 MB here, ~20 GB for 64 x 512 tokens x 150k). Collapse is watched instead: the entropy of the sampled
    positions is reported every step; its running mean over the latest entropy_window_tokens completion tokens is
    checked against [entropy_min, entropy_max] (learner.health_stats, EntropyWindow), with the share of A < 0 samples.
    Not used: advantage normalisation (divides ~0.05-scale reject advantages by a batch std of ~0.3: larger steps,
    the wrong direction for stability); per-context baselines (each context is served once: a group baseline needs
    n samples per request, n times the CPU serving cost).

``normalizer`` lets a caller split one batch into micro-batches and still get the exact batch loss: pass the token
count (token-mean) or the sequence count (seq-mean) of the whole batch, and the micro-batch losses add up to it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Aggregation = Literal["token-mean", "seq-mean"]
KLEstimator = Literal["k1", "k3"]


def tempered(logits: torch.Tensor, temperature: torch.Tensor | float | None) -> torch.Tensor:
    """z / T with one temperature per row: logits [B, ..., V], temperature [B] (or a scalar; None = 1).

    In float32, as vLLM's sampler divides: at T = 0.01 bf16 logits would lose the gaps that decide mu.
    """
    logits = logits.float()
    if temperature is None:
        return logits
    t = torch.as_tensor(temperature, dtype=torch.float32, device=logits.device)
    if t.dim() == 0:
        return logits if float(t) == 1.0 else logits / t
    if bool((t == 1.0).all()):
        return logits
    return logits / t.reshape(-1, *([1] * (logits.dim() - 1)))  # [B, 1, ..., 1]


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) at every position: logits [B, T, V] (already aligned: position t predicts targets[:, t]) -> [B, T].

    Uses logsumexp instead of a full log_softmax so only one [B, T, V] temporary is alive.
    """
    logits = logits.float()
    picked = torch.gather(logits, -1, targets.unsqueeze(-1)).squeeze(-1)  # [B, T]
    return picked - torch.logsumexp(logits, dim=-1)  # [B, T]


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the next-token distribution at every position: [B, T, V] -> [B, T]."""
    return token_logprobs_and_entropy(logits, None)[1]


def token_logprobs_and_entropy(
    logits: torch.Tensor, targets: torch.Tensor | None
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Both from one logsumexp: H = lse - sum_v p_v * z_v (p = softmax(z)); saves a vocabulary-wide pass."""
    logits = logits.float()  # [..., V]
    lse = torch.logsumexp(logits, dim=-1)  # [...]
    probs = torch.exp(logits - lse.unsqueeze(-1))  # [..., V]
    entropy = lse - (probs * logits).sum(-1)  # [...]
    logp = None
    if targets is not None:
        logp = torch.gather(logits, -1, targets.unsqueeze(-1)).squeeze(-1) - lse  # [...]
    return logp, entropy


def masked_aggregate(
    values: torch.Tensor, mask: torch.Tensor, mode: Aggregation, normalizer: float | None = None
) -> torch.Tensor:
    """Reduce [B, T] per-token values to a scalar over masked tokens (see module docstring for the two modes)."""
    mask = mask.to(values.dtype)
    if mode == "token-mean":
        denom = normalizer if normalizer is not None else mask.sum().clamp(min=1.0)
        return (values * mask).sum() / denom
    if mode == "seq-mean":
        per_seq = (values * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)  # [B]
        has_tokens = (mask.sum(-1) > 0).to(values.dtype)  # [B]: a sequence without tokens does not count
        denom = normalizer if normalizer is not None else has_tokens.sum().clamp(min=1.0)
        return (per_seq * has_tokens).sum() / denom
    raise ValueError(f"aggregation must be 'token-mean' or 'seq-mean', got {mode!r}")


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: KLEstimator = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) from log-probs of the sampled tokens: [B, T] -> [B, T]."""
    log_ratio = ref_logp - logp  # [B, T] = log(pi_ref / pi_theta)
    if estimator == "k3":
        return torch.exp(log_ratio) - log_ratio - 1.0
    if estimator == "k1":
        return -log_ratio
    raise ValueError(f"KL estimator must be 'k1' or 'k3', got {estimator!r}")


def truncated_is_weight(old_logp: torch.Tensor, behaviour_logp: torch.Tensor, cap: float) -> torch.Tensor:
    """min(pi_old / mu, cap) per token, detached: corrects for sampling from mu (the served policy), not pi_old."""
    return torch.exp(old_logp - behaviour_logp).clamp(max=cap).detach()


@dataclass
class PPOLossOutput:
    loss: torch.Tensor  # scalar, carries the gradient
    tensors: dict[str, torch.Tensor]  # clip fraction, approx KL, ratio statistics... as 0-d tensors (no device sync)

    @property
    def stats(self) -> dict[str, float]:
        """The statistics as floats: one device sync per read, so the update loop keeps ``tensors`` instead."""
        return {k: float(v) for k, v in self.tensors.items()}


def ppo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps: float = 0.2,
    clip_eps_negative: float | None = None,
    dual_clip: float | None = None,
    aggregation: Aggregation = "token-mean",
    normalizer: float | None = None,
    is_weight: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: KLEstimator = "k3",
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
) -> PPOLossOutput:
    """The token-level clipped surrogate (+ optional dual clip, KL, entropy), aggregated over ``mask``.

    Shapes: logp, old_logp, mask, is_weight, ref_logp, entropy: [B, T]; advantages: [B] (or [B, T]).
    ``clip_eps_negative`` is the lower ratio bound's eps for tokens with A < 0 (None: ``clip_eps``).
    """
    if clip_eps_negative is not None and not 0.0 < clip_eps_negative < 1.0:
        raise ValueError(f"clip_eps_negative must be in (0, 1), got {clip_eps_negative}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (Ye et al.), got {dual_clip}")
    mask = mask.to(logp.dtype)
    adv = advantages.to(logp.dtype)
    if adv.dim() == 1:
        adv = adv.unsqueeze(-1)  # [B, 1]: the sequence's advantage for each of its tokens
    adv = adv.expand_as(logp)  # [B, T]

    log_ratio = logp - old_logp.detach()  # [B, T]
    ratio = torch.exp(log_ratio)  # [B, T]
    unclipped = -adv * ratio  # [B, T]
    low = 1.0 - clip_eps
    if clip_eps_negative is not None:
        low = torch.where(adv < 0, 1.0 - clip_eps_negative, 1.0 - clip_eps)  # [B, T]
    clipped = -adv * torch.clamp(ratio, max=1.0 + clip_eps).clamp(min=low)  # [B, T] (low <= 1 < high)
    pg = torch.maximum(unclipped, clipped)  # [B, T] pessimistic (upper) bound of the loss
    clip_active = (clipped > unclipped).to(logp.dtype)  # [B, T] where the clip removed the gradient

    dual_active = torch.zeros_like(pg)
    if dual_clip is not None:
        dual_bound = -adv * dual_clip  # [B, T] for A < 0 this is c * |A|
        dual_active = ((adv < 0) & (pg > dual_bound)).to(logp.dtype)
        pg = torch.where(adv < 0, torch.minimum(pg, dual_bound), pg)

    if is_weight is not None:
        pg = pg * is_weight.detach()

    token_loss = pg
    kl = None
    if ref_logp is not None and kl_coef > 0:
        kl = kl_penalty(logp, ref_logp.detach(), kl_estimator)  # [B, T]
        token_loss = token_loss + kl_coef * kl
    if entropy is not None and entropy_coef > 0:
        token_loss = token_loss - entropy_coef * entropy

    loss = masked_aggregate(token_loss, mask, aggregation, normalizer)

    with torch.no_grad():
        n = mask.sum().clamp(min=1.0)
        masked_ratio = torch.where(mask > 0, ratio, torch.zeros_like(ratio))
        any_token = mask.sum() > 0
        one = torch.ones((), dtype=ratio.dtype, device=ratio.device)
        inf = torch.full_like(ratio, float("inf"))
        stats = {
            "pg_loss": masked_aggregate(pg, mask, aggregation),
            "clip_fraction": (clip_active * mask).sum() / n,
            "dual_clip_fraction": (dual_active * mask).sum() / n,
            # k3 estimate of KL(pi_old || pi_theta): non-negative, low variance (cf. Schulman's "Approximating KL").
            "approx_kl": (((ratio - 1.0) - log_ratio) * mask).sum() / n,
            "ratio_mean": (ratio * mask).sum() / n,
            "ratio_max": torch.where(any_token, masked_ratio.max(), one),
            "ratio_min": torch.where(any_token, torch.where(mask > 0, ratio, inf).min(), one),
            "tokens": mask.sum(),
        }
        if kl is not None:
            stats["kl"] = (kl * mask).sum() / n
        if entropy is not None:
            stats["entropy"] = (entropy * mask).sum() / n
        if is_weight is not None:
            stats["is_weight_mean"] = (is_weight * mask).sum() / n
    return PPOLossOutput(loss=loss, tensors={k: v.detach().float() for k, v in stats.items()})
