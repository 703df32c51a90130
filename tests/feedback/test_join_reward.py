"""Pure join and reward logic (no I/O): the relations Continue's trimming produces, and nothing else, match."""

from __future__ import annotations

import pytest

from onlinerl.config import FeedbackConfig, RewardConfig
from onlinerl.schemas import CompletionOutcome, RolloutRecord
from onlinerl.tokens import TokenTable, shown_token_count
from onlinerl_feedback.decide import decide
from onlinerl_feedback.join import common_prefix_join, find_join, match_span
from onlinerl_feedback.reward import reward_for

# A toy vocabulary (id = index); "" is EOS. tests/foundation/test_tokens.py covers the real tokenizers and Unicode.
VOCAB = ["", "ab", "cd", "ef", "c", "d", "\n"]
TABLE = TokenTable(tuple(p.encode() for p in VOCAB))


def record(pieces: list[str], tenant: str = "acme", created_at: float = 1.0, rid: str = "r1", offsets=None):
    """A rollout whose tokens are ``pieces`` (ids from VOCAB) and whose text is what they spell."""
    ids = [VOCAB.index(p) for p in pieces]
    return RolloutRecord(
        rollout_id=rid,
        tenant=tenant,
        policy_version=1,
        served_model="m",
        prompt="p",
        prompt_token_ids=[1, 2],
        completion="".join(pieces),
        completion_token_ids=ids,
        behaviour_logprobs=[-(i + 1) / 10 for i in range(len(ids))],
        token_offsets=offsets if offsets is not None else [],
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
    ids, text = [1, 2, 3, 0], "abcdef"  # "ab" "cd" "ef" EOS

    def kept(end: int, terminator: bool = False, table: TokenTable | None = TABLE) -> int:
        return shown_token_count(table, ids, text, end, terminator)

    assert kept(6) == 4  # whole text shown: EOS too
    assert kept(5) == 2  # cut inside "ef": it and everything after are dropped
    assert kept(4) == 2
    assert kept(0) == 0
    assert kept(6, table=None) == 4 and kept(5, table=None) == 0  # no tokenizer table: no safe cut
    # with the terminator: the token the display was cut on comes too, but nothing after it
    assert kept(4, True) == 3  # "ab" "cd" + "ef"
    assert kept(5, True) == 3  # cut inside "ef": "ef" is the terminator
    assert kept(6, True) == 4  # whole text shown: nothing to add
    assert kept(1, True) == 0  # no whole token shown: nothing to train on


def test_join_ignores_vllm_char_offsets():
    """Offsets that drift (as vLLM's do on split multi-byte characters) change nothing: the cut comes from the ids."""
    good = record(["ab", "cd", "\n", "ef"], offsets=[0, 2, 4, 5])
    drifted = record(["ab", "cd", "\n", "ef"], offsets=[0, 5, 9, 12])
    for r in (good, drifted):
        j = find_join([r], "abcd", "acme", TABLE)
        assert (j.match, j.token_ids, j.logprobs) == ("prefix", [1, 2, 6], [-0.1, -0.2, -0.3])  # + the newline


def test_best_join_prefers_exact_then_most_tokens_and_never_another_tenant():
    a = record(["ab", "cd", "ef"], rid="prefix-match")
    b = record(["ab", "c"], rid="exact-match")
    other = record(["ab", "c"], tenant="globex", rid="foreign")
    assert find_join([a, b, other], "abc", "acme", TABLE).record.rollout_id == "exact-match"
    assert find_join([other], "abc", "acme", TABLE) is None
    j = find_join([a], "abcd", "acme", TABLE)
    assert (j.match, j.token_ids, j.logprobs) == ("prefix", [1, 2, 3], [-0.1, -0.2, -0.3])  # + terminator
    assert common_prefix_join(a, "abX", TABLE).token_ids == [1]  # a mismatch is no display cut: no terminator


@pytest.mark.parametrize(
    ("preset", "accepted", "shown", "reward"),
    [
        ("chars", True, "abcd", 0.55),  # four characters: 0.5 + 4 x 0.0125
        ("chars", True, "  " + "x" * 20 + "\n", 0.75),  # trimmed: twenty characters, Cursor's flat value
        ("chars", True, "x" * 40, 1.0),
        ("chars", True, "x" * 400, 1.0),  # capped at a line
        ("chars", False, "x" * 40, -0.25),  # a reject costs the same at any length
        ("chars", True, "\n ", 0.0),
        ("cursor", True, "x", 0.75),
        ("cursor", True, "x" * 40, 0.75),
        ("cursor", False, "x", -0.25),
        ("cursor", True, " \n", 0.0),
        ("rlinf", True, "x", 1.0),
        ("rlinf", False, "x", 0.0),
        ("rlinf", True, "", 0.0),
    ],
)
def test_reward_presets(preset, accepted, shown, reward):
    assert reward_for(accepted, shown, RewardConfig(preset=preset)) == pytest.approx(reward)


def test_default_reward_pays_an_accept_by_its_length():
    cfg = RewardConfig()
    assert cfg.preset == "chars"
    rewards = [reward_for(True, "x" * n, cfg) for n in (4, 10, 20, 30, 40)]
    assert rewards == sorted(rewards) and len(set(rewards)) == 5
    assert reward_for(True, "x" * 4, cfg) > 0 > reward_for(False, "x", cfg)  # any accept beats silence beats a reject


def test_reward_counts_the_policys_text_not_the_clients_claim():
    """A client that uploads a longer text than was shown cannot buy a larger reward: the join pays the shown span of
    the rollout's own completion. Verified: the trimmed match pays the 4 characters without the padding."""
    rec = record(["ab", "cd", ""])
    padded = CompletionOutcome(completionId="c1", accepted=True, completion="  abcd  ", prompt="p")
    d = decide(padded, "acme", "p", [rec], FeedbackConfig(), now=5.0, table=TABLE)
    assert d.details["match"] == "trimmed" and d.details["reward"] == pytest.approx(0.55)
    forged = CompletionOutcome(completionId="c1", accepted=True, completion="ab" + "X" * 200, prompt="p")
    d = decide(forged, "acme", "p", [rec], FeedbackConfig(trainUnmatched=True), now=5.0, table=TABLE)
    assert d.details["match"] == "unverified" and d.details["reward"] == pytest.approx(0.5 + 2 * 0.0125)


def test_custom_reward_uses_the_numbers_given():
    cfg = RewardConfig(preset="custom", accepted=2.0, acceptedPerChar=0.0, rejected=-1.0, empty=-0.1)
    assert [reward_for(True, "x", cfg), reward_for(False, "x", cfg), reward_for(False, "", cfg)] == [2.0, -1.0, -0.1]


def test_decide_routes_unmatched_to_audit_unless_train_unmatched():
    ev = CompletionOutcome(completionId="c1", accepted=True, completion="abX", prompt="p")
    rec = record(["ab", "cd", ""])
    d = decide(ev, "acme", "p", [rec], FeedbackConfig(), now=5.0, table=TABLE)
    assert (d.status, d.to_samples, d.reason, d.stats) == ("unmatched", False, "text_mismatch", ())
    d = decide(ev, "acme", "p", [rec], FeedbackConfig(trainUnmatched=True), now=5.0, table=TABLE)
    assert (d.status, d.to_samples, d.details["match"], d.details["tokens"]) == (
        "accepted_for_training",
        True,
        "unverified",
        1,
    )
    assert decide(ev, "acme", "p", [], FeedbackConfig(trainUnmatched=True)).reason == "no_rollout"


def test_prompt_template_auto_reads_fim_tokens_from_tokenizer_json(tmp_path, smollm2_path):
    import json

    from onlinerl.config import from_mapping
    from onlinerl_feedback.prompts import configured_template, event_prompt

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
