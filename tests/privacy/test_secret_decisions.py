"""Feedback's decisions around a credential (pure, no I/O): a silence on a redacted rollout is audited
``secret_detected``; an event's own finding wins over a clear join, audited without text and never counted; a
redacted rollout of another user is not rated by this one (rate your own rollouts)."""

from __future__ import annotations

from onlinerl.config import from_mapping
from onlinerl.schemas import CompletionOutcome, RolloutRecord, SamplingParams, SecretFindingRecord
from onlinerl.secret_scan import scan_fields
from onlinerl_feedback.decide import SECRET_DETECTED, decide
from onlinerl_feedback.silence import decide_silence
from tests.privacy_corpus import fake_github_token

TOKEN = fake_github_token(9)


def rec(rid: str, user: str, completion: str = "return 1", redacted: bool = False) -> RolloutRecord:
    r = RolloutRecord(
        rollout_id=rid,
        tenant="acme",
        policy_version=0,
        served_model="m",
        user_hash=user,
        prompt="def f():\n    ",
        prompt_token_ids=[1, 2],
        completion=completion,
        completion_token_ids=[3, 4],
        behaviour_logprobs=[-1.0, -1.0],
        sampling=SamplingParams(temperature=0.7),
    )
    if redacted:
        finding = SecretFindingRecord(field="completion", kind="github_token", start=8, end=48)
        r = r.model_copy(
            update={
                "prompt": "",
                "completion": "",
                "prompt_token_ids": [],
                "completion_token_ids": [],
                "behaviour_logprobs": [],
                "secrets": [finding],
            }
        )
    return r


def event(text: str, cid: str = "c") -> CompletionOutcome:
    return CompletionOutcome.model_validate({"completionId": cid, "accepted": True, "completion": text})


def test_a_silence_on_a_redacted_rollout_is_audited_secret_detected() -> None:
    d = decide_silence(rec("r1", "u1", redacted=True), from_mapping({}).feedback.reward, 0.0)
    assert (d.to_samples, d.reason) == (False, SECRET_DETECTED)
    assert b'"user_hash":"u1"' in d.entry


def test_an_event_with_a_credential_is_never_trained_even_when_it_joins_in_clear() -> None:
    text = f'token = "{TOKEN}"'
    cfg = from_mapping({}).feedback
    found = scan_fields([("completion", text)])
    d = decide(event(text), "acme", "def f():\n    ", [rec("r1", "u1", text)], cfg, rater="u1", secrets=found)
    assert (d.reason, d.to_samples, d.counters, d.rates) == (SECRET_DETECTED, False, (), "r1")
    assert TOKEN.encode() not in d.entry


def test_another_users_redacted_rollout_is_not_rated_by_this_user() -> None:
    cfg = from_mapping({}).feedback
    d = decide(event("something else"), "acme", "def f():\n    ", [rec("r1", "u1", redacted=True)], cfg, rater="u2")
    assert d.reason != SECRET_DETECTED and d.rates == ""
    mine = decide(event("something else"), "acme", "def f():\n    ", [rec("r1", "u1", redacted=True)], cfg, rater="u1")
    assert (mine.reason, mine.rates, mine.to_samples) == (SECRET_DETECTED, "r1", False)


def test_the_gateway_s_three_modes() -> None:
    import pytest

    from onlinerl_serving.errors import ApiError
    from onlinerl_serving.screening import SecretScreen

    leaky = rec("r1", "u1", f'"{TOKEN}"')
    assert SecretScreen("off").screen(leaky) is leaky  # off: stored as served
    SecretScreen("audit").check_prompt(f"x = '{TOKEN}'")  # audit never refuses
    stored = SecretScreen("audit").screen(leaky)
    assert stored.redacted and stored.completion == "" and [s.kind for s in stored.secrets] == ["github_token"]
    clean = rec("r2", "u1")
    assert SecretScreen("audit").screen(clean) is clean  # nothing found: untouched
    with pytest.raises(ApiError) as refused:
        SecretScreen("block").check_prompt(f"x = '{TOKEN}'")
    assert (
        refused.value.status == 400 and refused.value.code == "secret_in_prompt" and TOKEN not in refused.value.message
    )
