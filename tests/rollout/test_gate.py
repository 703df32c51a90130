"""The pure eval gate: accept-rate margins and degenerate-output checks, each failure named with its figures."""

from __future__ import annotations

from onlinerl.config import GateConfig
from onlinerl_rollout.gate import EvalRecord, GateInput, GateThresholds, evaluate_gate, repetition_score

TH = GateThresholds.from_config(GateConfig(eval_samples=60))
CODE = [
    "return a + b",
    "for item in items:\n    total += item.price",
    "if not path.exists():\n    raise FileNotFoundError",
    "self.name = name\nself.size = size",
    "x = compute(y)",
]


def records(n: int = 60, accept_every: int = 3, text=lambda i: CODE[i % len(CODE)]) -> list[EvalRecord]:
    return [EvalRecord(text(i), i % accept_every == 0) for i in range(n)]


def gate(candidate: list[EvalRecord], stable: list[EvalRecord] | None = None):
    return evaluate_gate(GateInput(2, 1, candidate, stable if stable is not None else records()), TH)


def test_equal_candidate_passes_with_figures() -> None:
    result = gate(records())
    assert result.passed and result.reasons == ()
    assert result.candidate.accept_rate == result.stable.accept_rate == 20 / 60
    assert result.figures()["candidate"]["accepted_per_100"] == 100 * 20 / 60


def test_empty_candidate_fails() -> None:
    result = gate(records(text=lambda i: "" if i % 20 else "   "))
    assert not result.passed
    assert result.candidate.empty_rate == 1.0
    assert any(r.startswith("empty rate 1.000 > max 0.9") for r in result.reasons)
    assert any(r.startswith("accepted per 100 requests 0.00") for r in result.reasons)


def test_repetitive_candidate_fails() -> None:
    result = gate(records(text=lambda i: "foo(bar); " * 30))
    assert not result.passed and result.candidate.repetition_rate > 0.9
    assert any(r.startswith("repetition rate") for r in result.reasons)
    result = gate(records(text=lambda i: "x = 1\n" * 8))  # the same line over and over
    assert any(r.startswith("repetition rate") for r in result.reasons)


def test_length_checks() -> None:
    long = gate(records(text=lambda i: "\n".join(f"value_{i}_{j} = compute({j})" for j in range(40))))
    assert any("x stable's, max 4.0x" in r for r in long.reasons)
    short = gate(records(text=lambda i: "x"))
    assert any("x stable's, min 0.25x" in r for r in short.reasons)


def test_worse_accept_rate_fails_within_margin_passes() -> None:
    worse = gate(records(accept_every=6))  # 10 vs 20 of 60 accepted: P(candidate below stable) = 0.98
    assert any(r.startswith("accept rate 0.167 < stable 0.333 - margin 0.02 (P = 0.98") for r in worse.reasons)
    assert any(r.startswith("accepted per 100 requests 16.67 < stable 33.33") for r in worse.reasons)
    # 19/60 vs 20/60 accepted: within the 0.02 and 2.0 margins
    near = records()
    near[0] = EvalRecord(near[0].shown_text, False)
    assert gate(near).passed


def test_a_shortfall_within_noise_passes_and_a_credible_one_fails() -> None:
    """Run 11's gates (docs/demo.md): 64 held-out requests, stable accepted 7, the candidate 5 with shorter text.
    Past the 0.02 / 2.0 margins and the 0.75 accepted-characters floor by point figures, but P(candidate below) is
    0.72 and 0.81: noise at this size, so it passes (the canary judges it live). Three times the shortfall fails."""
    th = GateThresholds.from_config(GateConfig())  # the defaults: 64 records, confidence 0.95

    def run(accepted: int, text: str) -> list[EvalRecord]:
        return [EvalRecord(text if i < 60 else "", i < accepted) for i in range(64)]

    stable, near = run(7, "total += item.price * 2"), run(5, "total += 1")
    result = evaluate_gate(GateInput(2, 1, near, stable), th)
    assert result.candidate.accepted_per_100 < result.stable.accepted_per_100 - th.accepted_per_100_margin
    assert result.candidate.accepted_chars_per_100 < 0.75 * result.stable.accepted_chars_per_100
    assert result.passed, result.reasons
    far = evaluate_gate(GateInput(2, 1, run(0, "total += 1"), run(15, "total += item.price * 2")), th)
    assert not far.passed
    assert {r.split(" ")[0] for r in far.reasons} == {"accept", "accepted", "guardrail:"}
    assert all("(P = " in r and ">= 0.95)" in r for r in far.reasons)
    # a stricter gate (confidence 0.5) fails the noisy one too: the bar is the config's, not the code's
    assert not evaluate_gate(
        GateInput(2, 1, near, stable), GateThresholds.from_config(GateConfig(confidence=0.5))
    ).passed


def test_degenerate_stable_does_not_block_a_repair() -> None:
    """The base model loops on some prompts; a candidate that loops less must not fail for the base's sake."""

    def run(loops) -> list[EvalRecord]:  # nobody accepts a loop: it would count as accepted characters
        return [
            EvalRecord("<fim_middle>" * 20, False) if loops(i) else EvalRecord(CODE[i % 5], i % 3 == 0)
            for i in range(60)
        ]

    loopy, better = run(lambda i: i % 2), run(lambda i: i % 5 == 0)
    assert loopy and gate(better, loopy).passed


def test_too_few_records_fail() -> None:
    result = gate(records(n=10))
    assert not result.passed and "candidate eval has 10 records, the gate needs 60" in result.reasons[0]


def test_repetition_score_normal_code_is_low() -> None:
    assert repetition_score("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n") < 0.3
    assert repetition_score("self.a = a\nself.b = b\nself.c = c\n") == 0.0
    assert repetition_score("") == 0.0


def test_gate_input_from_eval_records() -> None:
    rows = [
        {"version": 2, "shown_text": "a", "accepted": True},
        {"policy_version": 1, "completion": "b", "accepted": False},
        {"version": 7, "shown_text": "c", "accepted": True},
    ]
    inp = GateInput.from_records(2, 1, rows)
    assert inp.candidate == (EvalRecord("a", True),) and inp.stable == (EvalRecord("b", False),)
