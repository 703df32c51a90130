"""What a served rollout that got no outcome teaches: pure, no I/O (the sweeper in sweeper.py writes it).

Continue uploads an outcome only for a suggestion it displayed. A rollout of a tracking tenant that is still unrated
when ``feedback.silence.windowSeconds`` have passed since it finished was therefore not shown (empty, filtered,
superseded while typing): the server produces the outcome the reward table defines for that, ``feedback.reward.empty``
(Cursor: 0). The sample trains the *whole* generated completion, since what is judged is the policy's decision to
say all of it; nothing of it was shown, so there is no cut. The rules of real events hold: an ``eval``-arm rollout
is counted under its arm only, never trained; a greedy one (temperature 0) has no log-prob the trainer can evaluate;
either way it is audited, rated and counted once. Cache hits never rate a rollout, so they neither block nor
replace its silence.
"""

from __future__ import annotations

from dataclasses import dataclass

from onlinerl.arms import EVAL
from onlinerl.config import RewardConfig
from onlinerl.keys import prompt_digest
from onlinerl.schemas import SILENCE_MATCH, AuditEntry, RolloutRecord, TrainingSample

from .decide import AUDIT_TEXT_LIMIT, EVAL_ARM, GREEDY, SECRET_DETECTED, Counters

SILENT = "silent"  # outcome in the rollout's rated mark and in the audit: the server, not a client, rated it
NO_TOKENS = "no_tokens"  # the record holds no generated token with a log-prob (nothing the trainer could learn)
EVENT_PREFIX = "silence:"  # event_id of a silence sample or audit entry: "silence:<rollout_id>"
COUNTERS: Counters = (("silent", 1),)  # stats:v{N}:{arm} field bumped once per silenced rollout


@dataclass(frozen=True)
class SilenceDecision:
    """What to append for one unrated rollout: a sample (``to_samples``) or an audit entry (``reason`` says why)."""

    to_samples: bool
    entry: bytes  # TrainingSample or AuditEntry JSON
    reason: str  # "" for a sample; eval_arm, greedy_sampling or no_tokens for an audit entry
    version: int
    arm: str
    counters: Counters = COUNTERS
    line: str = ""  # the policy line that served it (RolloutRecord.line): whose stats count it


def event_id(rollout_id: str) -> str:
    return f"{EVENT_PREFIX}{rollout_id}"


def _trainable_tokens(record: RolloutRecord) -> bool:
    n = len(record.completion_token_ids)
    return n > 0 and len(record.behaviour_logprobs) == n


def decide_silence(record: RolloutRecord, reward: RewardConfig, now: float) -> SilenceDecision:
    """The sample (reward ``reward.empty``, every generated token) or the audit entry for one silenced rollout."""
    if record.arm == EVAL or record.sampling.greedy or not _trainable_tokens(record):
        reason = EVAL_ARM if record.arm == EVAL else GREEDY if record.sampling.greedy else NO_TOKENS
        reason = SECRET_DETECTED if record.redacted else reason  # recorded without its text: a credential
        entry = AuditEntry(
            event_id=event_id(record.rollout_id),
            tenant=record.tenant,
            outcome=SILENT,
            reason=reason,
            completion=record.completion[:AUDIT_TEXT_LIMIT],
            prompt_digest=prompt_digest(record.prompt),
            received_at=now,
            rollout_id=record.rollout_id,
            user_hash=record.user_hash,
        ).to_json()
        return SilenceDecision(False, entry, reason, record.policy_version, record.arm, line=record.line)
    sample = TrainingSample(
        event_id=event_id(record.rollout_id),
        rollout_id=record.rollout_id,
        tenant=record.tenant,
        arm=record.arm,
        policy_version=record.policy_version,
        line=record.line,
        prompt_token_ids=record.prompt_token_ids,
        completion_token_ids=record.completion_token_ids,
        behaviour_logprobs=record.behaviour_logprobs,
        reward=reward.empty,
        accepted=False,
        temperature=record.sampling.temperature or 1.0,
        shown_text="",
        match=SILENCE_MATCH,
        rollout_created_at=record.created_at,
        feedback_at=now,
        user_hash=record.user_hash,
    ).to_json()
    return SilenceDecision(True, sample, "", record.policy_version, record.arm, line=record.line)
