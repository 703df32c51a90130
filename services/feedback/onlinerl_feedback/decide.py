"""From a validated event and the tenant's rollout records to what must be written: pure, no I/O.

The result (:class:`Decision`) names the stream (samples or audit), the JSON entry, the stats counters to bump and the
status the client will read. The store then writes it atomically; the HTTP layer only renders it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from onlinerl.config import FeedbackConfig
from onlinerl.keys import prompt_digest
from onlinerl.schemas import AuditEntry, CompletionOutcome, RolloutRecord, TrainingSample

from .join import Join, common_prefix_join, find_join
from .reward import is_empty_suggestion, reward_for

ACCEPTED = "accepted_for_training"
DUPLICATE = "duplicate"
UNMATCHED = "unmatched"
REJECTED = "rejected"
OUTCOMES = (ACCEPTED, DUPLICATE, UNMATCHED, REJECTED)

AUDIT_TEXT_LIMIT = 4096  # audit keeps the shown text for inspection, capped so a hostile client cannot bloat it


@dataclass(frozen=True)
class Decision:
    """What to append for one event, and what to tell the client once Redis acknowledged it."""

    status: str  # accepted_for_training | unmatched | rejected
    to_samples: bool
    entry: bytes  # TrainingSample or AuditEntry JSON
    reason: str = ""  # join miss (no_rollout, text_mismatch) or rejection reason
    stats: tuple[str, ...] = ()  # counters of stats:v{N}:{arm}
    version: int | None = None
    arm: str = ""
    details: dict = field(default_factory=dict)  # extra reply fields (rollout_id, match, reward, tokens)


def _audit(event: CompletionOutcome, tenant: str, prompt: str, status: str, reason: str, now: float) -> bytes:
    return AuditEntry(
        event_id=event.completion_id,
        tenant=tenant,
        outcome=status,
        reason=reason,
        accepted=event.accepted,
        completion=event.completion[:AUDIT_TEXT_LIMIT],
        prompt_digest=prompt_digest(prompt),
        received_at=now,
    ).to_json()


def _stats_fields(event: CompletionOutcome) -> tuple[str, ...]:
    """Counters a rated, server-produced completion bumps. An empty suggestion is not 'shown' (nothing to accept)."""
    if is_empty_suggestion(event.completion):
        return ("empty",)
    return ("shown", "accepted" if event.accepted else "rejected")


def _sample(event: CompletionOutcome, tenant: str, joined: Join, reward: float, match: str, now: float) -> bytes:
    r = joined.record
    return TrainingSample(
        event_id=event.completion_id,
        rollout_id=r.rollout_id,
        tenant=tenant,
        arm=r.arm,
        policy_version=r.policy_version,
        prompt_token_ids=r.prompt_token_ids,
        completion_token_ids=joined.token_ids,
        behaviour_logprobs=joined.logprobs,
        reward=reward,
        accepted=event.accepted,
        temperature=r.sampling.temperature if r.sampling.temperature else 1.0,
        shown_text=event.completion,
        match=match,
        rollout_created_at=r.created_at,
        feedback_at=now,
    ).to_json()


def decide(
    event: CompletionOutcome,
    tenant: str,
    prompt: str,
    records: list[RolloutRecord],
    cfg: FeedbackConfig,
    now: float | None = None,
) -> Decision:
    """Join, reward and route one event (see docs/architecture.md, "Join rule")."""
    now = time.time() if now is None else now
    own = [r for r in records if r.tenant == tenant]
    joined = find_join(own, event.completion, tenant)
    if joined is None:
        reason = "text_mismatch" if own else "no_rollout"
        if cfg.train_unmatched and own:
            newest = max(own, key=lambda r: r.created_at)
            partial = common_prefix_join(newest, event.completion)
            if partial.token_ids:
                reward = reward_for(event.accepted, event.completion, cfg.reward)
                return Decision(
                    ACCEPTED,
                    True,
                    _sample(event, tenant, partial, reward, "unverified", now),
                    reason,
                    version=newest.policy_version,
                    arm=newest.arm,
                    details={
                        "rollout_id": newest.rollout_id,
                        "match": "unverified",
                        "reward": reward,
                        "tokens": len(partial.token_ids),
                    },
                )
        return Decision(UNMATCHED, False, _audit(event, tenant, prompt, UNMATCHED, reason, now), reason)

    r = joined.record
    stats = _stats_fields(event)
    base = {"rollout_id": r.rollout_id, "policy_version": r.policy_version, "match": joined.match}
    if not joined.token_ids:
        # Server-produced and shown, but no whole generated token lies in the shown text: nothing to learn from.
        reason = "no_shown_tokens"
        return Decision(
            REJECTED,
            False,
            _audit(event, tenant, prompt, REJECTED, reason, now),
            reason,
            stats,
            r.policy_version,
            r.arm,
            base,
        )
    reward = reward_for(event.accepted, event.completion, cfg.reward)
    return Decision(
        ACCEPTED,
        True,
        _sample(event, tenant, joined, reward, joined.match, now),
        "",
        stats,
        r.policy_version,
        r.arm,
        {**base, "reward": reward, "tokens": len(joined.token_ids)},
    )
