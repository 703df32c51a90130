"""From TrainingSample records to padded tensors, and the staleness decision. Pure functions (no Redis, no model).

Layout of one row (LEFT padding): ``pad ++ prompt ++ completion``. Position t of the logits predicts token t + 1,
so the trained targets are ``input_ids[:, 1:]`` and every per-token tensor below has T - 1 columns. Left padding
puts every completion at the end of its row, so the vocabulary projection (the dominant cost of a small model with
a 49k vocabulary) only has to run on the last ``max_completion_len`` positions (HF ``logits_to_keep``), not on the
prompts, which are usually far longer than the completions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from onlinerl.schemas import TrainingSample


@dataclass
class StreamSample:
    """One stream entry: its id (the sample id), the decoded record, and how stale it is at batch time."""

    sample_id: str
    sample: TrainingSample
    staleness: int = 0
    stale_weight_cap: float | None = None  # set when the sample is stale and kept with a truncated IS weight


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T] long
    attention_mask: torch.Tensor  # [B, T] long
    targets: torch.Tensor  # [B, T-1] long: input_ids shifted left
    completion_mask: torch.Tensor  # [B, T-1] float: 1 where the target is a trained completion token
    behaviour_logp: torch.Tensor  # [B, T-1] float: serving's log-prob of each target (0 off the mask)
    rewards: torch.Tensor  # [B]
    is_cap: torch.Tensor  # [B]: per-sequence cap on the importance weight (inf = none)
    temperature: torch.Tensor  # [B] float: the sampling temperature; pi is evaluated as softmax(logits / T) (loss.py)

    @property
    def num_tokens(self) -> int:
        return int(self.completion_mask.sum())

    @property
    def position_ids(self) -> torch.Tensor:
        """[B, T] positions counted from each row's first real token (left padding shifts rows)."""
        return (self.attention_mask.cumsum(-1) - 1).clamp(min=0)

    @property
    def completion_span(self) -> int:
        """How many trailing target columns hold completion tokens (the longest completion)."""
        cols = self.completion_mask.sum(0) > 0  # [T-1]
        return int(cols.shape[0] - cols.nonzero()[0, 0]) if bool(cols.any()) else 0

    def rows(self, start: int, stop: int) -> Batch:
        """A micro-batch: rows [start, stop), trimmed (from the left) to its own longest row."""
        length = int(self.attention_mask[start:stop].sum(-1).max())
        return Batch(
            input_ids=self.input_ids[start:stop, -length:],
            attention_mask=self.attention_mask[start:stop, -length:],
            targets=self.targets[start:stop, -(length - 1) :],
            completion_mask=self.completion_mask[start:stop, -(length - 1) :],
            behaviour_logp=self.behaviour_logp[start:stop, -(length - 1) :],
            rewards=self.rewards[start:stop],
            is_cap=self.is_cap[start:stop],
            temperature=self.temperature[start:stop],
        )


def fit_to_length(
    prompt: list[int], completion: list[int], logprobs: list[float], max_len: int
) -> tuple[list[int], list[int], list[float]]:
    """The row exactly as served, or ValueError when it is longer than ``max_len``. Never cut: dropping prompt tokens
    would condition pi_theta on a context vLLM never saw (the ratio would not be 1 at step 0). The trainer drops and
    counts such samples before batching (validation.py, reason ``too_long``); this is the last line of defence."""
    if len(prompt) + len(completion) > max_len:
        raise ValueError(f"row of {len(prompt)} + {len(completion)} tokens exceeds max_len {max_len}: never cut")
    return prompt, completion, logprobs


def collate(samples: Sequence[StreamSample], max_len: int, pad_id: int) -> Batch:
    """Pad a list of samples into one Batch (left padding)."""
    rows = []
    for s in samples:
        rec = s.sample
        if len(rec.behaviour_logprobs) != len(rec.completion_token_ids):
            raise ValueError(f"sample {s.sample_id}: behaviour_logprobs and completion_token_ids differ in length")
        rows.append(
            fit_to_length(
                list(rec.prompt_token_ids), list(rec.completion_token_ids), list(rec.behaviour_logprobs), max_len
            )
        )
    width = max(len(p) + len(c) for p, c, _ in rows)
    b = len(rows)
    input_ids = torch.full((b, width), pad_id, dtype=torch.long)
    attention = torch.zeros((b, width), dtype=torch.long)
    comp_mask = torch.zeros((b, width - 1), dtype=torch.float32)
    behaviour = torch.zeros((b, width - 1), dtype=torch.float32)
    for i, (prompt, completion, logprobs) in enumerate(rows):
        n = len(prompt) + len(completion)
        input_ids[i, width - n :] = torch.tensor(prompt + completion, dtype=torch.long)
        attention[i, width - n :] = 1
        # target index j predicts input_ids[j + 1]: the completion's targets are the last len(completion) columns.
        comp_mask[i, width - 1 - len(completion) :] = 1.0
        behaviour[i, width - 1 - len(completion) :] = torch.tensor(logprobs, dtype=torch.float32)
    return Batch(
        input_ids=input_ids,
        attention_mask=attention,
        targets=input_ids[:, 1:].clone(),
        completion_mask=comp_mask,
        behaviour_logp=behaviour,
        rewards=torch.tensor([s.sample.reward for s in samples], dtype=torch.float32),
        is_cap=torch.tensor(
            [s.stale_weight_cap if s.stale_weight_cap is not None else float("inf") for s in samples],
            dtype=torch.float32,
        ),
        temperature=torch.tensor([s.sample.temperature for s in samples], dtype=torch.float32),
    )


StaleAction = Literal["keep", "drop", "downweight"]


def staleness(sample_version: int, trainer_version: int, oldest_served: int | None = None) -> int:
    """How many versions serving has moved past the one that generated the sample.

    Measured against the oldest version serving still gives users (``oldest_served``: the policy table's stable,
    or an older pinned or candidate version), capped at the trainer's own version. A sample of a version users are
    still served is fresh, however far the trainer or the candidates have moved: under a canary the trainer writes
    versions faster than the rollout promotes them, and stable's samples (half or more of the traffic) must keep
    teaching. Counting against the trainer's version dropped all of them once it was ``maxVersions`` ahead (learning
    stopped, screening run A); counting against the newest served version (a run of candidates) did the same once
    the candidates were ``maxVersions`` ahead of stable. How far the trainer's weights have moved from the behaviour
    policy is the PPO ratio's business (the clip, the dual clip and the KL to the base bound it), not this count's.
    ``None`` (table unreadable): the trainer's version, the strict reading.
    """
    floor = trainer_version if oldest_served is None else min(trainer_version, oldest_served)
    return max(0, floor - sample_version)


def staleness_action(staleness_versions: int, max_versions: int, mode: Literal["drop", "truncate"]) -> StaleAction:
    """Samples more than ``max_versions`` behind serving (see :func:`staleness`) are dropped or down-weighted."""
    if staleness_versions <= max_versions:
        return "keep"
    return "drop" if mode == "drop" else "downweight"
