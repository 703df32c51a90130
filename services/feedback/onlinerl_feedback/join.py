"""Join a feedback event to the completion the gateway served: pure functions, no I/O.

Continue post-processes what the model generated before showing it: it may cut the text (the shown text is a prefix
of the generation) or strip whitespace around it. We accept exactly those three relations (``exact``, ``prefix``,
``trimmed``) and nothing else, so a client can never make us train on text the policy did not produce.

Which tokens are trained on: the longest *prefix* of the generated tokens whose text ends inside the shown span,
plus the **terminator**: the one token on which Continue cut the display (the blank line, the newline in single-line
mode, the start of the line below the cursor). That token is the policy's decision to end the suggestion there, so
it gets the credit for an accept and the blame for a reject; without it the policy could never learn *where to stop*,
which is most of what separates an accepted suggestion from a rejected one. A prefix (never a gap) keeps
``prompt + kept tokens`` identical to what the policy actually conditioned on, so the behaviour log-probs stay valid.
Leading whitespace that Continue stripped is kept (the model produced it and the shown text was conditioned on it);
everything after the terminator is dropped.

The cut is computed from the token ids through the tokenizer's byte table (onlinerl/tokens.py), in bytes: a token
is shown iff its last byte lies inside the shown text's bytes. vLLM's char ``text_offset`` (``token_offsets``) is not
used: it drifts on any token holding part of a multi-byte character. Without a table no cut is safe (see
``shown_token_count``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from onlinerl.schemas import RolloutRecord
from onlinerl.tokens import TokenTable, shown_token_count

MatchKind = Literal["exact", "prefix", "trimmed"]
_RANK: dict[str, int] = {"exact": 0, "prefix": 1, "trimmed": 2}


@dataclass(frozen=True)
class Span:
    """How the shown text relates to one generated text: the kind of match and the shown char span in it."""

    match: MatchKind
    start: int
    end: int


@dataclass(frozen=True)
class Join:
    """A matched event: the rollout, how it matched, and the tokens kept for training."""

    record: RolloutRecord
    span: Span
    token_ids: list[int]
    logprobs: list[float]

    @property
    def match(self) -> MatchKind:
        return self.span.match

    @property
    def shown_text(self) -> str:
        """The shown span of the policy's own text: what a length-aware reward pays for (never the client's claim,
        so a client cannot inflate a reward with characters the policy did not write)."""
        return self.record.completion[self.span.start : self.span.end]


def match_span(generated: str, shown: str) -> Span | None:
    """The relation between generated and shown text, or None when the shown text is not derived from it."""
    if shown == generated:
        return Span("exact", 0, len(generated))
    if shown and generated.startswith(shown):
        return Span("prefix", 0, len(shown))
    core = shown.strip()
    lead = len(generated) - len(generated.lstrip())
    if not core:
        # Whitespace-only shown text joins only a whitespace-only generation (an empty suggestion): keep it all.
        return Span("trimmed", 0, len(generated)) if not generated.strip() else None
    if generated[lead:].startswith(core):
        return Span("trimmed", lead, lead + len(core))
    return None


def cut_to_span(record: RolloutRecord, span: Span, table: TokenTable | None, terminator: bool = True) -> Join:
    """The record with its token lists cut to the shown span and its terminator (see module doc), in bytes."""
    n = min(len(record.completion_token_ids), len(record.behaviour_logprobs))
    ids = record.completion_token_ids[:n]
    k = shown_token_count(table, ids, record.completion, span.end, terminator)
    return Join(record, span, list(ids[:k]), list(record.behaviour_logprobs[:k]))


def find_join(records: Iterable[RolloutRecord], shown: str, tenant: str, table: TokenTable | None) -> Join | None:
    """The best matching rollout of ``tenant`` for the shown text: exact > prefix > trimmed, then the most tokens
    kept, then the newest. Records of another tenant never match (defence in depth: keys are tenant-scoped)."""
    best: tuple[tuple[int, int, float], Join] | None = None
    for record in records:
        if record.tenant != tenant:
            continue
        span = match_span(record.completion, shown)
        if span is None:
            continue
        joined = cut_to_span(record, span, table)
        rank = (_RANK[span.match], -len(joined.token_ids), -record.created_at)
        if best is None or rank < best[0]:
            best = (rank, joined)
    return None if best is None else best[1]


def common_prefix_join(record: RolloutRecord, shown: str, table: TokenTable | None) -> Join:
    """For ``feedback.trainUnmatched`` only: the tokens of the longest common prefix of generated and shown text."""
    limit = 0
    for a, b in zip(record.completion, shown, strict=False):
        if a != b:
            break
        limit += 1
    return cut_to_span(record, Span("prefix", 0, limit), table, terminator=False)  # a mismatch is no display cut
