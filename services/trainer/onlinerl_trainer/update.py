"""One PPO update on one batch: old / reference log-probs, then ``ppo_epochs`` passes of micro-batched gradient steps.

Backend-agnostic (``engine.Engine``). The batch loss is exact under micro-batching: each micro-batch loss is divided
by the *batch's* token (or sequence) count, and gradients accumulate until the last micro-batch (the boundary).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812 - the usual torch alias

from onlinerl.config import AlgorithmConfig
from onlinerl_trainer.batching import Batch
from onlinerl_trainer.engine import Engine
from onlinerl_trainer.loss import (
    ppo_loss,
    tempered,
    token_logprobs,
    token_logprobs_and_entropy,
    truncated_is_weight,
)
from onlinerl_trainer.policy import adapter_disabled, is_lora
from onlinerl_trainer.ranks import Ranks, shard_slices


@dataclass
class UpdateResult:
    stats: dict[str, float] = field(default_factory=dict)
    grad_norm: float = 0.0
    skipped_reason: str | None = None  # "nonfinite_loss" | "nonfinite_grad"


SINGLE = Ranks()
ENTROPY_SAMPLE_TOKENS = 64  # tokens per micro-batch for the entropy gauge when entropy is not in the loss


@dataclass
class TokenLogprobs:
    logp: torch.Tensor  # [B, T-1] log pi(target), zeros left of the completion span
    entropy: torch.Tensor | None = None  # [B, T-1], only when the loss needs it (with its graph)
    entropy_estimate: torch.Tensor | None = None  # 0-d: mean entropy over sampled completion tokens (monitoring)


def completion_logprobs(
    engine: Engine, mb: Batch, with_entropy: bool = False, entropy_grad: bool = False, module: nn.Module | None = None
) -> TokenLogprobs:
    """Log-probs of a micro-batch's completion tokens (and its entropy, exact for the loss or sampled for the gauge),
    under softmax(logits / T) with each row's sampling temperature: the distribution vLLM sampled it from.

    Only the trailing completion span goes through the vocabulary projection (left padding + ``logits_to_keep``):
    with a 49k vocabulary and prompts far longer than completions, that projection is the largest cost. A
    vocabulary-wide entropy costs several more passes over [B, span, V], so the gauge samples at most
    ``ENTROPY_SAMPLE_TOKENS`` completion positions (evenly spaced) unless the entropy bonus needs it everywhere.
    """
    span = max(mb.completion_span, 1)
    kwargs = {
        "input_ids": mb.input_ids.to(engine.device),
        "attention_mask": mb.attention_mask.to(engine.device),
        "position_ids": mb.position_ids.to(engine.device),
        "logits_to_keep": span + 1,
    }
    logits = engine.forward(**kwargs) if module is None else module(**kwargs).logits  # [B, span + 1, V]
    # [B, span, V]: the last position predicts past the end; / T per row: pi is the tempered policy vLLM sampled from
    logits = tempered(logits[:, :-1], mb.temperature.to(logits.device))
    targets = mb.targets[:, -span:].to(logits.device)  # [B, span]
    left = mb.targets.shape[1] - span  # columns of pure prompt / padding
    if with_entropy and entropy_grad:
        logp, ent = token_logprobs_and_entropy(logits, targets)  # [B, span] each
        mask = mb.completion_mask[:, -span:].to(ent.device)
        estimate = (ent.detach() * mask).sum() / mask.sum().clamp(min=1)
        return TokenLogprobs(F.pad(logp, (left, 0)), F.pad(ent, (left, 0)), estimate)
    out = TokenLogprobs(F.pad(token_logprobs(logits, targets), (left, 0)))  # [B, T-1]
    if with_entropy:
        with torch.no_grad():
            rows, cols = (mb.completion_mask[:, -span:] > 0).nonzero(as_tuple=True)  # [N] each
            pick = torch.linspace(0, len(rows) - 1, min(len(rows), ENTROPY_SAMPLE_TOKENS)).round().long()
            sampled = logits.detach()[rows[pick].to(logits.device), cols[pick].to(logits.device)]  # [k, V]
            est = token_logprobs_and_entropy(sampled, None)[1].float().mean() if len(rows) else None
            out.entropy_estimate = est
    return out


@torch.no_grad()
def _reference_logprobs(engine: Engine, mb: Batch, reference: nn.Module | None) -> torch.Tensor:
    if reference is not None:
        return completion_logprobs(engine, mb, module=reference).logp
    if not is_lora(engine.module):
        raise ValueError("a KL penalty with full fine-tuning needs a reference model")
    with adapter_disabled(engine.module):
        return completion_logprobs(engine, mb).logp


def _micro_slices(size: int, micro: int) -> list[tuple[int, int]]:
    return [(i, min(i + micro, size)) for i in range(0, size, micro)]


def ppo_update(
    engine: Engine,
    batch: Batch,
    advantages: torch.Tensor,
    algo: AlgorithmConfig,
    micro_batch_size: int,
    reference: nn.Module | None = None,
    ranks: Ranks = SINGLE,
) -> UpdateResult:
    """Train on ``batch`` (advantages [B]); returns token-weighted mean statistics and whether the step was skipped.

    Data parallel (``ranks.world > 1``): every rank holds the whole batch and runs its round-robin share of the
    micro-batches (padded with zero-loss passes so all ranks take part in every all-reduce). Each loss is divided by
    the *batch's* normaliser and multiplied by the world size, because DeepSpeed averages gradients over ranks: the
    averaged gradient is then exactly the single-process batch gradient.
    """
    size = batch.input_ids.shape[0]
    slices = _micro_slices(size, micro_batch_size)
    mine = shard_slices(slices, ranks)  # this rank's micro-batches; None = a zero-loss pass
    micro = [batch.rows(*(sl or slices[0])) for sl in mine]
    adv = [advantages[slice(*(sl or slices[0]))] for sl in mine]
    live = [1.0 if sl is not None else 0.0 for sl in mine]
    stale_rows = [torch.isfinite(mb.is_cap) for mb in micro]  # [b] per micro-batch: down-weighted stale samples
    need_recompute = algo.old_logprobs == "recompute" or bool(torch.isfinite(batch.is_cap).any())
    use_kl = algo.kl_coef > 0

    # --- fixed per batch: old log-probs, importance weights, reference log-probs ---------------------------------
    old, weights, refs = [], [], []
    with torch.no_grad():
        for mb, stale in zip(micro, stale_rows, strict=True):
            behaviour = mb.behaviour_logp.to(engine.device)  # [b, T-1]
            cap = mb.is_cap.to(engine.device).unsqueeze(-1)  # [b, 1]
            if need_recompute:
                recomputed = completion_logprobs(engine, mb).logp  # [b, T-1] pi_old = the weights before this update
                if algo.old_logprobs == "recompute":
                    old.append(recomputed)
                    w = truncated_is_weight(recomputed, behaviour, algo.is_truncation)
                    weights.append(torch.minimum(w, cap))
                else:
                    stale_col = stale.to(engine.device).unsqueeze(-1)  # [b, 1]
                    old.append(torch.where(stale_col, recomputed, behaviour))
                    w = torch.minimum(torch.exp(recomputed - behaviour), cap)
                    weights.append(torch.where(stale_col, w, torch.ones_like(w)))
            else:
                old.append(behaviour)
                weights.append(None)
            refs.append(_reference_logprobs(engine, mb, reference) if use_kl else None)

    mask_total = float(batch.completion_mask.sum())
    seqs_total = float((batch.completion_mask.sum(-1) > 0).sum())
    normalizer = max(mask_total, 1.0) if algo.aggregation == "token-mean" else max(seqs_total, 1.0)

    # --- gradient steps -----------------------------------------------------------------------------------------
    # Statistics stay 0-d tensors on the device and are read once, at the end of the step (nanoGPT / TRL style): a
    # float() per micro-batch would wait for the device every time.
    zero = torch.zeros((), dtype=torch.float64, device=engine.device)
    totals: dict[str, torch.Tensor] = {}
    weight_sum, ratio_max = zero.clone(), zero.clone()
    grad_norm = 0.0
    epoch_losses: list[torch.Tensor] = []
    for _epoch in range(algo.ppo_epochs):
        loss_sum, nonfinite = zero.clone(), torch.zeros((), dtype=torch.bool, device=engine.device)
        for i, mb in enumerate(micro):
            is_boundary = i == len(micro) - 1
            lp = completion_logprobs(engine, mb, with_entropy=True, entropy_grad=algo.entropy_coef > 0)
            logp = lp.logp
            out = ppo_loss(
                logp,
                old[i],
                adv[i].to(logp.device),
                mb.completion_mask.to(logp.device),
                clip_eps=algo.clip_eps,
                clip_eps_negative=algo.clip_eps_negative,
                dual_clip=algo.dual_clip,
                aggregation=algo.aggregation,
                normalizer=normalizer,
                is_weight=weights[i],
                ref_logp=refs[i],
                kl_coef=algo.kl_coef,
                kl_estimator=algo.kl_estimator,
                entropy=lp.entropy,
                entropy_coef=algo.entropy_coef,
            )
            # A non-finite loss poisons the accumulated gradient (x NaN) so the backend's own non-finite check drops
            # the whole step on every rank (DeepSpeed ZeRO keeps partial gradients in its own buffers; this clears
            # them the same way). A finite loss is multiplied by exactly 1. The remaining passes still run, so the
            # ranks' all-reduces stay in step; the check happens once, after the epoch.
            finite = torch.isfinite(out.loss.detach())
            nonfinite |= ~finite
            poison = torch.where(finite, 1.0, float("nan")).to(out.loss.dtype)
            engine.backward(out.loss * (live[i] * ranks.world) * poison, is_boundary=is_boundary)
            t = out.tensors
            loss_sum = loss_sum + out.loss.detach().float() * live[i]
            n = t["tokens"] * live[i]
            weight_sum = weight_sum + n
            if live[i]:
                ratio_max = torch.maximum(ratio_max, t["ratio_max"])
            t["entropy"] = lp.entropy_estimate if lp.entropy_estimate is not None else zero
            for key, value in t.items():
                if key not in ("tokens", "ratio_max", "ratio_min"):
                    totals[key] = totals.get(key, zero) + value * n
        result = engine.step()
        grad_norm = result.grad_norm
        epoch_losses.append(loss_sum)  # micro-batch losses add up to the batch loss (shared normalizer)
        poisoned = bool(nonfinite)  # the step's device sync (engine.step() has read the grad norm already)
        if poisoned or result.skipped:
            reason = "nonfinite_loss" if poisoned else "nonfinite_grad"
            summed, weight, top, _ = _read(totals, weight_sum, ratio_max, [], ranks=None)
            stats = _finish(summed, weight, top)
            return UpdateResult(stats=stats, grad_norm=grad_norm, skipped_reason=reason)
    summed, weight, top, losses = _read(
        totals, weight_sum, ratio_max, epoch_losses, ranks if ranks.distributed else None
    )
    stats = _finish(summed, weight, top)
    stats["loss"] = sum(losses) / len(losses)
    stats["tokens"] = mask_total
    return UpdateResult(stats=stats, grad_norm=grad_norm)


def _read(
    totals: dict[str, torch.Tensor],
    weight_sum: torch.Tensor,
    ratio_max: torch.Tensor,
    epoch_losses: list[torch.Tensor],
    ranks: Ranks | None,
) -> tuple[dict[str, float], float, float, list[float]]:
    """The step's one device read: every accumulated statistic in one tensor. Data parallel: the sums are summed
    over ranks (each rank saw its shard, so they add up to the batch's); ``ratio_max`` stays this rank's."""
    keys = sorted(totals)
    packed = torch.stack(
        [totals[k].double() for k in keys] + [weight_sum.double()] + [x.double() for x in epoch_losses]
    )
    if ranks is not None:
        packed = ranks.sum_tensor(packed)
    values = torch.cat([packed, ratio_max.double().reshape(1)]).tolist()
    n = len(keys)
    return dict(zip(keys, values[:n], strict=True)), values[n], values[-1], values[n + 1 : -1]


def _finish(totals: dict[str, float], weight_sum: float, ratio_max: float) -> dict[str, float]:
    stats = {k: v / max(weight_sum, 1.0) for k, v in totals.items()}
    stats["ratio_max"] = ratio_max
    return stats
