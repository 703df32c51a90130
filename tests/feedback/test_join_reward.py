"""Pure join and reward logic (no I/O): the relations Continue's trimming produces, and nothing else, match."""

from __future__ import annotations

import pytest
from onlinerl_feedback.decide import decide
from onlinerl_feedback.join import find_join, kept_token_count, match_span
from onlinerl_feedback.reward import reward_for

from onlinerl.config import FeedbackConfig, RewardConfig
from onlinerl.schemas import CompletionOutcome, RolloutRecord


def record(completion: str, offsets: list[int], tenant: str = "acme", created_at: float = 1.0, rid: str = "r1"):
    n = len(offsets)
    return RolloutRecord(
        rollout_id=rid,
        tenant=tenant,
        policy_version=1,
        served_model="m",
        prompt="p",
        prompt_token_ids=[1, 2],
        completion=completion,
        completion_token_ids=list(range(10, 10 + n)),
        behaviour_logprobs=[-0.1] * n,
        token_offsets=offsets,
        created_at=created_at,
    )


@pytest.mark.parametrize(
    ("generated", "shown", "expected"),
    [
        ("abc", "abc", ("exact", 0, 3)),
        ("abc\ndef", "abc", ("prefix", 0, 3)),
        ("\n  abc  \n", "abc", ("trimmed", 3, 6)),
        ("\n  abc def", " abc", ("trimmed", 3, 6)),
        ("  \n", "", ("trimmed", 0, 3)),
        ("", "", ("exact", 0, 0)),
        ("abc", "abd", None),
        ("abc", "abcd", None),  # longer than generated: text added by the client
        ("abc", "", None),  # a non-empty generation shown as nothing is not an empty suggestion of this rollout
        ("x = 1", "x  = 1", None),
    ],
)
def test_match_span(generated, shown, expected):
    span = match_span(generated, shown)
    assert (None if span is None else (span.match, span.start, span.end)) == expected


def test_kept_tokens_are_a_prefix_ending_inside_the_span():
    # tokens: "ab" [0,2) "cd" [2,4) "ef" [4,6) EOS [6,6)
    offsets = [0, 2, 4, 6]
    assert kept_token_count(offsets, 6, 6, 4) == 4  # whole text shown: EOS too
    assert kept_token_count(offsets, 6, 5, 4) == 2  # cut inside "ef": it and everything after are dropped
    assert kept_token_count(offsets, 6, 4, 4) == 2
    assert kept_token_count(offsets, 6, 0, 4) == 0
    assert kept_token_count([], 6, 6, 4) == 4 and kept_token_count([], 6, 5, 4) == 0  # no offsets: no safe cut
    # with the terminator: the token the display was cut on comes too, but nothing after it
    assert kept_token_count(offsets, 6, 4, 4, terminator=True) == 3  # "ab" "cd" + "ef"
    assert kept_token_count(offsets, 6, 5, 4, terminator=True) == 3  # cut inside "ef": "ef" is the terminator
    assert kept_token_count(offsets, 6, 6, 4, terminator=True) == 4  # whole text shown: nothing to add
    assert kept_token_count(offsets, 6, 1, 4, terminator=True) == 0  # no whole token shown: nothing to train on


def test_best_join_prefers_exact_then_most_tokens_and_never_another_tenant():
    a = record("abcdef", [0, 2, 4], rid="prefix-match")
    b = record("abc", [0, 2], rid="exact-match")
    other = record("abc", [0, 2], tenant="globex", rid="foreign")
    assert find_join([a, b, other], "abc", "acme").record.rollout_id == "exact-match"
    assert find_join([other], "abc", "acme") is None
    j = find_join([a], "abcd", "acme")
    assert (j.match, j.token_ids, j.logprobs) == ("prefix", [10, 11, 12], [-0.1, -0.1, -0.1])  # + terminator


@pytest.mark.parametrize(
    ("preset", "accepted", "shown", "reward"),
    [
        ("cursor", True, "x", 0.75),
        ("cursor", False, "x", -0.25),
        ("cursor", True, " \n", 0.0),
        ("rlinf", True, "x", 1.0),
        ("rlinf", False, "x", 0.0),
        ("rlinf", True, "", 0.0),
    ],
)
def test_reward_presets(preset, accepted, shown, reward):
    assert reward_for(accepted, shown, RewardConfig(preset=preset)) == reward


def test_custom_reward_uses_the_numbers_given():
    cfg = RewardConfig(preset="custom", accepted=2.0, rejected=-1.0, empty=-0.1)
    assert [reward_for(True, "x", cfg), reward_for(False, "x", cfg), reward_for(False, "", cfg)] == [2.0, -1.0, -0.1]


def test_decide_routes_unmatched_to_audit_unless_train_unmatched():
    ev = CompletionOutcome(completionId="c1", accepted=True, completion="abX", prompt="p")
    rec = record("abcd", [0, 2, 4])
    d = decide(ev, "acme", "p", [rec], FeedbackConfig(), now=5.0)
    assert (d.status, d.to_samples, d.reason, d.stats) == ("unmatched", False, "text_mismatch", ())
    d = decide(ev, "acme", "p", [rec], FeedbackConfig(trainUnmatched=True), now=5.0)
    assert (d.status, d.to_samples, d.details["match"], d.details["tokens"]) == (
        "accepted_for_training",
        True,
        "unverified",
        1,
    )
    assert decide(ev, "acme", "p", [], FeedbackConfig(trainUnmatched=True)).reason == "no_rollout"


def test_prompt_template_auto_reads_fim_tokens_from_tokenizer_json(tmp_path, smollm2_path):
    import json

    from onlinerl_feedback.prompts import configured_template, event_prompt

    from onlinerl.config import from_mapping

    assert configured_template(from_mapping({"model": {"path": str(smollm2_path)}})).name == "plain"  # no FIM tokens
    (tmp_path / "tokenizer.json").write_text(
        json.dumps({"model": {"vocab": {"a": 0}}, "added_tokens": [{"content": t} for t in QWEN_FIM]})
    )
    qwen = configured_template(from_mapping({"model": {"path": str(tmp_path)}}))
    assert qwen.name == "qwen"
    ev = CompletionOutcome(completionId="c", accepted=True, prefix="def f(", suffix=")")
    assert event_prompt(ev, qwen) == "<|fim_prefix|>def f(<|fim_suffix|>)<|fim_middle|>"
    posted = CompletionOutcome(completionId="c", accepted=True, prompt="raw", prefix="x")
    assert event_prompt(posted, qwen) == "raw"  # the posted prompt wins: the gateway keyed its record by it


QWEN_FIM = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")
