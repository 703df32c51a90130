"""Which stream entries the trainer may learn from. Pure checks on one decoded record: no Redis, no model.

Why the trainer checks what feedback already built: the stream is an input like any other (a bug, an old writer, a
hand-made XADD), and one bad row must not take the trainer down or poison the weights: a token id outside the
vocabulary is an index error in the embedding, a NaN reward or log-prob turns every weight NaN, a positive log-prob is
not a probability. Such an entry is acknowledged and counted under its reason (``onlinerl_trainer_invalid_samples``),
never trained. A valid sample that does not fit ``trainer.maxSeqLen`` is dropped (``too_long``), never cut: cutting
the prompt would condition pi_theta on a context vLLM never saw, so the PPO ratio would not be 1 at step 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from onlinerl.schemas import TrainingSample

# vLLM's log-probs come from a log-softmax (<= 0 exactly); this only absorbs float noise of a recomputation.
LOGPROB_TOLERANCE = 1e-6


@dataclass(frozen=True)
class Rejection:
    """Why a record is not trained: ``invalid`` (malformed) or ``dropped`` (valid but unusable), with the reason label
    of the matching counter and a message for the log."""

    kind: Literal["invalid", "dropped"]
    reason: str
    detail: str


def _bad_ids(ids: list[int], vocab_size: int) -> list[int]:
    return [t for t in ids if not 0 <= t < vocab_size]


def sample_problem(sample: TrainingSample, vocab_size: int, max_seq_len: int) -> Rejection | None:
    """None when ``sample`` can be trained exactly as served; else the first problem found."""
    prompt, completion, logprobs = sample.prompt_token_ids, sample.completion_token_ids, sample.behaviour_logprobs
    if not prompt or not completion:
        return Rejection("invalid", "empty", "empty prompt or completion")
    if len(logprobs) != len(completion):
        return Rejection(
            "invalid",
            "length_mismatch",
            f"{len(logprobs)} behaviour_logprobs for {len(completion)} completion_token_ids",
        )
    bad = _bad_ids(prompt, vocab_size) + _bad_ids(completion, vocab_size)
    if bad:
        return Rejection("invalid", "out_of_vocab", f"token ids {bad[:5]} outside the vocabulary [0, {vocab_size})")
    wrong = [lp for lp in logprobs if not (math.isfinite(lp) and lp <= LOGPROB_TOLERANCE)]
    if wrong:
        return Rejection("invalid", "bad_logprob", f"behaviour log-probs {wrong[:5]} are not finite and <= 0")
    if not math.isfinite(sample.reward):
        return Rejection("invalid", "bad_reward", f"reward {sample.reward!r} is not finite")
    if not math.isfinite(sample.temperature):
        return Rejection("invalid", "bad_temperature", f"temperature {sample.temperature!r} is not finite")
    length = len(prompt) + len(completion)
    if length > max_seq_len:
        return Rejection(
            "dropped",
            "too_long",
            f"prompt + completion = {length} tokens > trainer.maxSeqLen {max_seq_len} (never cut: vLLM saw it all)",
        )
    return None
