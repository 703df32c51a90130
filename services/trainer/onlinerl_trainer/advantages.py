"""Advantages without a critic: the Monte-Carlo return of a one-step episode (its reward) minus a baseline.

A completion is one action sequence rewarded once, so the return is the reward itself. A baseline only reduces
variance; it must not depend on the sample's own action, which is why the running baseline used for a batch is the
value *before* that batch is folded in.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from onlinerl.config import AlgorithmConfig

Baseline = Literal["running", "batch", "none"]


@dataclass
class RunningBaseline:
    """Exponential moving average of the reward per tenant (tenants differ in how often they accept).

    A tenant seen for the first time starts at ``prior`` (the trainer passes the reward table's ``empty`` value: the
    reward of saying nothing, the natural zero of "was this worth showing"). Starting at the batch's own mean instead
    would make a first batch of rejects its own baseline: advantage 0, no gradient, while the policy keeps serving
    them. ``prior=None`` keeps that old behaviour.
    """

    momentum: float = 0.9
    means: dict[str, float] = field(default_factory=dict)
    prior: float | None = 0.0

    def _start(self, tenant: str, batch_means: dict[str, float]) -> float:
        return batch_means[tenant] if self.prior is None else self.prior

    def values(self, tenants: Sequence[str], rewards: Sequence[float]) -> list[float]:
        """Baseline per sample: the tenant's mean before this batch (its prior when it was never seen)."""
        batch = _group_means(tenants, rewards)
        return [self.means[t] if t in self.means else self._start(t, batch) for t in tenants]

    def update(self, tenants: Sequence[str], rewards: Sequence[float]) -> None:
        batch = _group_means(tenants, rewards)
        for tenant, mean in batch.items():
            old = self.means[tenant] if tenant in self.means else self._start(tenant, batch)
            self.means[tenant] = self.momentum * old + (1.0 - self.momentum) * mean

    def state_dict(self) -> dict[str, float]:
        return dict(self.means)

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.means = {str(k): float(v) for k, v in state.items()}


def _group_means(keys: Sequence[str], values: Sequence[float]) -> dict[str, float]:
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for k, v in zip(keys, values, strict=True):
        sums[k] = sums.get(k, 0.0) + v
        counts[k] = counts.get(k, 0) + 1
    return {k: sums[k] / counts[k] for k in sums}


def compute_advantages(
    rewards: Sequence[float],
    tenants: Sequence[str],
    *,
    baseline: Baseline,
    running: RunningBaseline | None = None,
    normalize: bool = False,
    eps: float = 1e-6,
) -> list[float]:
    """A_i = R_i - b_i, optionally divided by the batch std of A (the baseline already centres it).

    ``running`` is updated with this batch after its baseline values are taken.
    """
    if len(rewards) != len(tenants):
        raise ValueError("rewards and tenants must have the same length")
    if not rewards:
        return []
    if baseline == "running":
        if running is None:
            raise ValueError("baseline 'running' needs a RunningBaseline")
        base = running.values(tenants, rewards)
        running.update(tenants, rewards)
    elif baseline == "batch":
        mean = sum(rewards) / len(rewards)
        base = [mean] * len(rewards)
    elif baseline == "none":
        base = [0.0] * len(rewards)
    else:
        raise ValueError(f"baseline must be running, batch or none, got {baseline!r}")
    adv = [r - b for r, b in zip(rewards, base, strict=True)]
    if normalize and len(adv) > 1:
        mean = sum(adv) / len(adv)
        std = math.sqrt(sum((a - mean) ** 2 for a in adv) / len(adv))
        adv = [a / (std + eps) for a in adv]
    return adv


def keep_fraction(sample_id: str) -> float:
    """A uniform number in [0, 1) fixed by the sample's id: a redelivered sample gets the same keep decision."""
    digest = hashlib.blake2b(sample_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def subsample_negatives(
    sample_ids: Sequence[str], advantages: Sequence[float], rate: float, weight: float = 1.0
) -> tuple[list[int], list[float]]:
    """Subsampling of negative advantages: (indices to train, their advantages).

    On CPU most events are rejects with a small negative advantage each (the default reward, ~92% rejects), and the
    trainer's forward/backward passes, not the data, are the scarce resource. Each negative-advantage sample is
    trained with probability ``rate`` and its advantage multiplied by ``weight / rate``, so the rejects' expected
    gradient is ``weight`` times the full one (E[1{kept} A weight / rate] = weight A). ``weight`` 1 is the unbiased
    policy gradient; its cost is variance: at rate 0.15 each kept reject carries 6.7x its advantage, and a batch's
    one or two accepts share it with a few rejects whose noise (credit on every token of a sequence, the correct
    first line included) is 2.6x larger than without subsampling. ``weight = rate`` trains each kept reject at its
    own advantage: the default weight 0.05 equals the cpu profile's rate (docs/demo.md, "Offline screen": weight 1
    moved nothing held-out, 0.15 learned; run 16: 0.05 learned further). Positive and zero advantages are always
    kept, unscaled.
    """
    if not 0.0 < rate <= 1.0:
        raise ValueError(f"negative sample rate must be in (0, 1], got {rate}")
    if not 0.0 < weight <= 1.0:
        raise ValueError(f"negative weight must be in (0, 1], got {weight}")
    keep: list[int] = []
    weighted: list[float] = []
    for i, (sid, a) in enumerate(zip(sample_ids, advantages, strict=True)):
        if a >= 0.0:
            keep.append(i)
            weighted.append(a)
        elif rate >= 1.0 or keep_fraction(sid) < rate:
            keep.append(i)
            weighted.append(a * weight / rate)
    return keep, weighted


def is_inert(advantage: float, kl_coef: float, entropy_coef: float) -> bool:
    """A sample whose loss has no gradient: advantage 0 and no KL or entropy term acting on it. The trainer
    acknowledges it without a forward pass (on CPU most of its time)."""
    return advantage == 0.0 and kl_coef == 0.0 and entropy_coef == 0.0


@dataclass(frozen=True)
class Selection:
    """What one admitted batch trains (indices into it, with their advantages), and what it leaves, by reason."""

    train: list[int]
    advantages: list[float]
    subsampled: list[int]  # negative advantages not drawn (negativeSampleRate)
    inert: list[int]  # no gradient at all (is_inert): acknowledged without a forward pass


def cap_unseen(advantages: Sequence[float], unseen: Sequence[bool] | None) -> list[float]:
    """A silence sample ("not shown": a tracked rollout nobody rated) never gets a positive advantage.

    Its reward (``reward.empty``, 0) sits above a baseline that rejects pulled negative, so 0 - b > 0 pushed up, token
    by token, a completion nobody saw: the policy learned to write what the client does not show. What silence should
    teach is "say nothing here" (the end token at that position), a target vLLM recorded no log-prob for. Until that
    is built, silence only ever pushes its completion down (when the tenant's baseline is above ``empty``: the
    suggestion was worth less than the average outcome) and is inert otherwise; it still counts in the baseline.
    """
    if unseen is None:
        return list(advantages)
    return [min(a, 0.0) if u else a for a, u in zip(advantages, unseen, strict=True)]


def select_trainable(
    sample_ids: Sequence[str],
    rewards: Sequence[float],
    tenants: Sequence[str],
    algo: AlgorithmConfig,
    running: RunningBaseline | None,
    unseen: Sequence[bool] | None = None,
) -> Selection:
    """The trainer's whole rule from rewards to trained samples, in its order: advantages against the baseline
    (which sees every reward, kept or not), silence samples (``unseen``) capped at 0 (:func:`cap_unseen`), then
    rejects subsampled and weighted (:func:`subsample_negatives`), then samples without gradient dropped
    (:func:`is_inert`: with the ``rlinf`` reward and no baseline, every reject). The feed and the tests'
    single-process references both call this, so they cannot drift apart."""
    adv = compute_advantages(
        rewards, tenants, baseline=algo.baseline, running=running, normalize=algo.normalize_advantages
    )
    adv = cap_unseen(adv, unseen)
    keep, weighted = subsample_negatives(sample_ids, adv, algo.negative_sample_rate, algo.negative_weight)
    kept = set(keep)
    subsampled = [i for i in range(len(adv)) if i not in kept]
    train: list[int] = []
    advantages: list[float] = []
    inert: list[int] = []
    for i, a in zip(keep, weighted, strict=True):
        if is_inert(a, algo.kl_coef, algo.entropy_coef):
            inert.append(i)
        else:
            train.append(i)
            advantages.append(a)
    return Selection(train, advantages, subsampled, inert)
