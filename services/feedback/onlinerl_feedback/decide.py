"""From a validated event and the tenant's rollout records to what must be written: pure, no I/O.

The result (:class:`Decision`) names the stream (samples or audit), the JSON entry, the stats counters to bump, the
rollout it rates and the status the client will read. The store then writes it atomically; the HTTP layer only
renders it.

One served rollout is rated at most once, whatever the ``completionId`` (the client makes those up): the first event
that joins it sets ``rated:{rollout_id}`` in the rollout's hash, in the same Lua script as its XADD (store.py), and
any later event that can only join rated rollouts is a ``duplicate``: audited, never trained, never counted.
What is never trained, only audited: cache hits (Continue served them from its own cache; the gateway served nothing)
and events that join an ``eval``-arm rollout (an evaluation asked for that version; it is not user traffic). An eval
event still counts once, under ``stats:v{N}:eval`` only, so the evaluator's figures can be read back; the canary's
arms (stable, candidate) never see it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from onlinerl.arms import EVAL
from onlinerl.config import FeedbackConfig
from onlinerl.keys import prompt_digest
from onlinerl.schemas import AuditEntry, CompletionOutcome, RolloutRecord, TrainingSample
from onlinerl.secret_scan import FieldFinding
from onlinerl.tokens import TokenTable

from .join import Join, common_prefix_join, find_join
from .reward import is_empty_suggestion, reward_for

ACCEPTED = "accepted_for_training"
DUPLICATE = "duplicate"
UNMATCHED = "unmatched"
REJECTED = "rejected"
OUTCOMES = (ACCEPTED, DUPLICATE, UNMATCHED, REJECTED)

# Reasons of a `duplicate` reply: the completionId was recorded before, or the rollout it joins was already rated.
COMPLETION_ID_SEEN = "completion_id_seen"
ROLLOUT_ALREADY_RATED = "rollout_already_rated"
# Reasons of a `rejected` (audited, never trained) event that was otherwise well formed.
CACHE_HIT = "cache_hit"
EVAL_ARM = "eval_arm"
GREEDY = "greedy_sampling"  # temperature 0: no log-prob of a tempered softmax describes an argmax (schemas.py)
NO_SHOWN_TOKENS = "no_shown_tokens"
# The text joins only a rollout served to another key of the tenant (feedback.rateScope user): audited, never trained
# or counted, and that rollout stays unrated for the user it was served to.
NOT_OWN_ROLLOUT = "not_own_rollout"
# The rollout names a policy line that is neither the shared one nor the rating tenant's own (issue 39): only a bug or
# a forged record can say so. Audited, rated (once), never trained and never counted: not in another project's canary.
FOREIGN_LINE = "foreign_line"
# Reasons of a `rejected` event that would have contributed but whose user may not (limits.py, decided in the script).
CONTRIBUTION_LIMIT = "contribution_limit"
QUARANTINED = "quarantined"
# The event's prompt or shown text holds a credential, or it rates a rollout the gateway recorded without its text for
# holding one (privacy.secretScreening, onlinerl/secret_scan.py): audited without any text, never trained or counted.
SECRET_DETECTED = "secret_detected"

AUDIT_TEXT_LIMIT = 4096  # audit keeps the shown text for inspection, capped so a hostile client cannot bloat it

Counters = tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class Decision:
    """What to append for one event, and what to tell the client once Redis acknowledged it."""

    status: str  # accepted_for_training | duplicate | unmatched | rejected
    to_samples: bool
    entry: bytes  # TrainingSample or AuditEntry JSON
    reason: str = ""  # join miss (no_rollout, text_mismatch), rejection or duplicate reason
    counters: Counters = ()  # (field, amount) of stats:v{N}:{arm}, bumped once with the append
    version: int | None = None
    arm: str = ""
    details: dict = field(default_factory=dict)  # extra reply fields (rollout_id, match, reward, tokens)
    rates: str = ""  # rollout_id this event rates (sets its rated mark); "" = rates none
    first: str = ""  # duplicate only: "<outcome> <entry id>" of the event that rated the rollout
    served_user: str = ""  # the rated rollout's user_hash (who was served): its canary's per-user ledger counts it
    canary: int | None = None  # the rated rollout's canary (RolloutRecord.canary); None: no per-user ledger
    line: str = ""  # the policy line that served the rated rollout (RolloutRecord.line): whose stats count it

    @property
    def contributes(self) -> bool:
        """Trained on, or counted in a canary arm's stats: what the per-user limits and quarantine apply to (an
        eval-arm event is an evaluation's own request, counted under ``eval`` only)."""
        return self.to_samples or (bool(self.counters) and self.arm != EVAL)

    @property
    def stats(self) -> tuple[str, ...]:
        """Names of the counters bumped (the metrics mirror them)."""
        return tuple(name for name, _ in self.counters)


def audit_entry(
    event: CompletionOutcome,
    tenant: str,
    prompt: str,
    status: str,
    reason: str,
    now: float,
    rollout_id: str = "",
    first: str = "",
    sender: str = "",
) -> bytes:
    """The audit stream's record of an event that is not trained on (``first``: what a duplicate repeats; ``sender``:
    the sending key's user hash, which `onlinerl forget` finds it by)."""
    first_outcome, _, first_entry_id = first.partition(" ")
    return AuditEntry(
        event_id=event.completion_id,
        tenant=tenant,
        outcome=status,
        reason=reason,
        accepted=event.accepted,
        completion=event.completion[:AUDIT_TEXT_LIMIT],
        prompt_digest=prompt_digest(prompt),
        received_at=now,
        rollout_id=rollout_id,
        first_outcome=first_outcome,
        first_entry_id=first_entry_id,
        user_hash=sender,
    ).to_json()


def stats_counters(accepted: bool, shown_text: str) -> Counters:
    """Counters a rated, server-produced completion bumps. An empty suggestion is not 'shown' (nothing to accept).
    ``shown_chars``/``accepted_chars`` add the length in characters (Unicode code points) of ``shown_text``, the
    rollout's own shown span (``Join.shown_text``, what the reward pays for), so the rollout guardrails can tell a
    policy that gets accepted more by saying less. Never the client's claim: the join accepts whitespace around the
    served text, and one accept padded with 3,000 spaces must not add 3,000 accepted characters to an arm."""
    if is_empty_suggestion(shown_text):
        return (("empty", 1),)
    chars = len(shown_text)
    if accepted:
        return (("shown", 1), ("accepted", 1), ("shown_chars", chars), ("accepted_chars", chars))
    return (("shown", 1), ("rejected", 1), ("shown_chars", chars))


def _sample(event: CompletionOutcome, tenant: str, joined: Join, reward: float, match: str, now: float) -> bytes:
    r = joined.record
    return TrainingSample(
        event_id=event.completion_id,
        rollout_id=r.rollout_id,
        tenant=tenant,
        arm=r.arm,
        policy_version=r.policy_version,
        line=r.line,
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
        user_hash=r.user_hash,
    ).to_json()


def duplicate(
    event: CompletionOutcome,
    tenant: str,
    prompt: str,
    reason: str,
    first: str,
    rollout_id: str = "",
    now: float = 0.0,
    sender: str = "",
) -> Decision:
    """An event that repeats one already counted: audited (with what it repeats), nothing trained, nothing counted."""
    now = now or time.time()
    first_outcome, _, first_entry_id = first.partition(" ")
    details = {"first_outcome": first_outcome, "entry_id": first_entry_id}
    if rollout_id:
        details["rollout_id"] = rollout_id
    return Decision(
        DUPLICATE,
        False,
        audit_entry(event, tenant, prompt, DUPLICATE, reason, now, rollout_id, first, sender),
        reason,
        details=details,
        first=first,
    )


def served_to(record: RolloutRecord, rater: str | None) -> bool:
    """Whether ``rater`` (the rating key's ``onlinerl.auth.user_hash``; None: any key of the tenant, ``rateScope:
    tenant``) may rate ``record``. A record without a user (written before records named one) is the tenant's."""
    return rater is None or not record.user_hash or record.user_hash == rater


def own_line(record: RolloutRecord, tenant: str) -> bool:
    """Whether ``record``'s policy line may be counted for ``tenant``: the shared line or the tenant's own project
    line. Any other line is a bug or a forgery, never counted into another project's canary (``FOREIGN_LINE``)."""
    return record.line in ("", tenant)


def _best_unrated(
    own: list[RolloutRecord], rated: dict[str, str], shown: str, tenant: str, table: TokenTable | None
) -> Join | None:
    """The join among rollouts not rated yet: user traffic first, then eval (the same text may have been served to
    both; an event then most likely belongs to the user's rollout, and either way each rollout counts once)."""
    unrated = [r for r in own if r.rollout_id not in rated]
    user = [r for r in unrated if r.arm != EVAL]
    joined = find_join(user, shown, tenant, table)
    if joined is None and len(user) < len(unrated):
        joined = find_join([r for r in unrated if r.arm == EVAL], shown, tenant, table)
    return joined


def secret_decision(
    event: CompletionOutcome,
    tenant: str,
    prompt: str,
    now: float,
    rates: RolloutRecord | None,
    findings: Sequence[FieldFinding],
) -> Decision:
    """An event that holds a credential, or rates a rollout recorded without its text for holding one: audited with
    no text at all (the finding kinds and positions go in the reply only), never trained, no counter. It rates the
    rollout when there is one, so a silence or a later event cannot produce a sample for it."""
    rid = rates.rollout_id if rates is not None else ""
    scrubbed = event.model_copy(update={"completion": ""})
    entry = audit_entry(scrubbed, tenant, prompt, REJECTED, SECRET_DETECTED, now, rid)
    details: dict = {"findings": [{"field": f.field, "kind": f.kind, "start": f.start, "end": f.end} for f in findings]}
    if rid:
        details["rollout_id"] = rid
    return Decision(
        REJECTED,
        False,
        entry,
        SECRET_DETECTED,
        details=details,
        rates=rid,
        served_user=rates.user_hash if rates is not None else "",
    )


def _with_sender(decision: Decision, sender: str) -> Decision:
    """Stamp the sending key's user hash on an audit entry (samples carry the served user's already)."""
    if not sender or decision.to_samples:
        return decision
    entry = AuditEntry.from_json(decision.entry).model_copy(update={"user_hash": sender})
    return replace(decision, entry=entry.to_json())


def decide(
    event: CompletionOutcome,
    tenant: str,
    prompt: str,
    records: list[RolloutRecord],
    cfg: FeedbackConfig,
    now: float | None = None,
    rated: dict[str, str] | None = None,
    table: TokenTable | None = None,
    rater: str | None = None,
    secrets: Sequence[FieldFinding] = (),
    sender: str = "",
) -> Decision:
    """Join, reward and route one event (see docs/architecture.md, "Join rule"). ``rated``: rollout_id -> first
    outcome of the rollouts of this prompt already rated when they were read (the append re-checks atomically);
    ``table``: the served model's token byte table the join cuts with (join.py); ``rater``: the rating key's user
    hash, so it joins only rollouts served to it (None: any of the tenant's, ``feedback.rateScope: tenant``);
    ``secrets``: what the secret screening found in the event itself (``SECRET_DETECTED``); ``sender``: the sending
    key's user hash, stamped on the audit entry."""
    return _with_sender(_decide(event, tenant, prompt, records, cfg, now, rated, table, rater, secrets), sender)


def _decide(
    event: CompletionOutcome,
    tenant: str,
    prompt: str,
    records: list[RolloutRecord],
    cfg: FeedbackConfig,
    now: float | None,
    rated: dict[str, str] | None,
    table: TokenTable | None,
    rater: str | None,
    secrets: Sequence[FieldFinding],
) -> Decision:
    now = time.time() if now is None else now
    rated = rated or {}
    if event.cache_hit:
        scrubbed = event.model_copy(update={"completion": ""}) if secrets else event
        return Decision(REJECTED, False, audit_entry(scrubbed, tenant, prompt, REJECTED, CACHE_HIT, now), CACHE_HIT)
    own = [r for r in records if r.tenant == tenant and served_to(r, rater)]
    clear = [r for r in own if not r.redacted]
    joined = _best_unrated(clear, rated, event.completion, tenant, table)
    hidden = [r for r in own if r.redacted and r.rollout_id not in rated]
    if secrets or (joined is None and hidden):
        # the rollout it rates: the one it joined, else the newest unrated one recorded without its text
        target = joined.record if joined is not None else max(hidden, key=lambda r: r.created_at, default=None)
        found = list(secrets) or [
            FieldFinding(f.field, f.kind, f.start, f.end) for f in (target.secrets if target else ())
        ]
        return secret_decision(event, tenant, prompt, now, target, found)
    if joined is None and rated:
        again = find_join([r for r in clear if r.rollout_id in rated], event.completion, tenant, table)
        if again is not None:
            rid = again.record.rollout_id
            return duplicate(event, tenant, prompt, ROLLOUT_ALREADY_RATED, rated[rid], rid, now)
    if joined is None:
        others = [r for r in records if not served_to(r, rater) and not r.redacted]
        foreign = find_join(others, event.completion, tenant, table)
        if foreign is not None:  # another key's rollout: audited with it, left for its own user to rate
            entry = audit_entry(event, tenant, prompt, REJECTED, NOT_OWN_ROLLOUT, now, foreign.record.rollout_id)
            return Decision(REJECTED, False, entry, NOT_OWN_ROLLOUT)
        reason = "text_mismatch" if own else "no_rollout"
        trainable = [
            r
            for r in clear
            if r.rollout_id not in rated and r.arm != EVAL and not r.sampling.greedy and own_line(r, tenant)
        ]
        if cfg.train_unmatched and trainable:
            newest = max(trainable, key=lambda r: r.created_at)
            partial = common_prefix_join(newest, event.completion, table)
            if partial.token_ids:
                reward = reward_for(event.accepted, partial.shown_text, cfg.reward)
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
                    rates=newest.rollout_id,
                    line=newest.line,
                )
        return Decision(UNMATCHED, False, audit_entry(event, tenant, prompt, UNMATCHED, reason, now), reason)

    r = joined.record
    if not own_line(r, tenant):
        entry = audit_entry(event, tenant, prompt, REJECTED, FOREIGN_LINE, now, r.rollout_id)
        return Decision(REJECTED, False, entry, FOREIGN_LINE, details={"rollout_id": r.rollout_id}, rates=r.rollout_id)
    counters = stats_counters(event.accepted, joined.shown_text)
    base = {"rollout_id": r.rollout_id, "policy_version": r.policy_version, "match": joined.match}
    if r.arm == EVAL or not joined.token_ids or r.sampling.greedy:
        # eval: an evaluation's request, counted under its own arm only. No whole generated token in the shown text:
        # server-produced and shown, but nothing to learn from. Greedy: served and shown, but its mu is no softmax
        # the trainer can evaluate. Either way the rollout is rated and counted once.
        reason = EVAL_ARM if r.arm == EVAL else NO_SHOWN_TOKENS if not joined.token_ids else GREEDY
        return Decision(
            REJECTED,
            False,
            audit_entry(event, tenant, prompt, REJECTED, reason, now, r.rollout_id),
            reason,
            counters,
            r.policy_version,
            r.arm,
            base,
            rates=r.rollout_id,
            served_user=r.user_hash,
            canary=r.canary,
            line=r.line,
        )
    reward = reward_for(event.accepted, joined.shown_text, cfg.reward)
    return Decision(
        ACCEPTED,
        True,
        _sample(event, tenant, joined, reward, joined.match, now),
        "",
        counters,
        r.policy_version,
        r.arm,
        {**base, "reward": reward, "tokens": len(joined.token_ids)},
        rates=r.rollout_id,
        served_user=r.user_hash,
        canary=r.canary,
        line=r.line,
    )
