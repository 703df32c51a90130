"""The pure decision math: posteriors, looks, alpha spending, and the promote / rollback / hold rules."""

from __future__ import annotations

import random

import pytest

from onlinerl.rollout.records import ArmStats
from onlinerl_rollout.decision import (
    DecisionRules,
    Guardrails,
    accepted_length_ratio,
    decide,
    decide_canary,
    look_index,
    look_threshold,
)
from onlinerl_rollout.posterior import EXACT_TERMS, BetaPosterior, _normal_prob_greater, prob_greater

# the guardrail mechanism, tested at a mean-shown-length floor of 0.5 (the default, 0.25, is a collapse backstop)
RULES = DecisionRules(
    min_samples=200,
    min_dwell_seconds=60,
    promote_probability=0.95,
    rollback_probability=0.95,
    guardrails=Guardrails(min_shown_length_ratio=0.5),
)


def arm(shown: int, rate: float, served: int | None = None) -> ArmStats:
    accepted = round(shown * rate)
    return ArmStats(shown=shown, accepted=accepted, rejected=shown - accepted, served=served or shown)


@pytest.mark.parametrize(("a", "b"), [((60, 200), (72, 200)), ((3, 10), (1, 12)), ((300, 1000), (330, 1000))])
def test_exact_probability_matches_monte_carlo(a, b) -> None:
    pa, pb = BetaPosterior.from_counts(*a), BetaPosterior.from_counts(*b)
    rng = random.Random(0)
    n = 40_000
    mc = sum(rng.betavariate(pb.alpha, pb.beta) > rng.betavariate(pa.alpha, pa.beta) for _ in range(n)) / n
    assert prob_greater(pa, pb) == pytest.approx(mc, abs=0.01)
    assert prob_greater(pa, pb) + prob_greater(pb, pa) == pytest.approx(1.0, abs=1e-9)


def test_probability_edge_cases_and_large_counts() -> None:
    assert prob_greater(BetaPosterior(1, 1), BetaPosterior(1, 1)) == pytest.approx(0.5)
    same = BetaPosterior.from_counts(300, 1000)
    assert prob_greater(same, same) == pytest.approx(0.5, abs=1e-9)
    big_a = BetaPosterior.from_counts(EXACT_TERMS + 5000, 100_000)
    big_b = BetaPosterior.from_counts(EXACT_TERMS + 5600, 100_000)
    assert prob_greater(big_a, big_b) == _normal_prob_greater(big_a, big_b)  # normal approximation path
    assert 0.99 < prob_greater(big_a, big_b) < 1.0
    # the exact sum and the normal approximation agree where both are cheap
    a, b = BetaPosterior.from_counts(6000, 20_000), BetaPosterior.from_counts(6100, 20_000)
    assert prob_greater(a, b) == pytest.approx(_normal_prob_greater(a, b), abs=1e-4)


def test_looks_double_and_thresholds_tighten() -> None:
    assert [look_index(n, 200) for n in (0, 199, 200, 399, 400, 799, 800, 1600, 3199, 3200)] == [
        -1,
        -1,
        0,
        0,
        1,
        1,
        2,
        3,
        3,
        4,
    ]
    assert [look_threshold(0.95, k) for k in range(4)] == pytest.approx([0.975, 0.9875, 0.99375, 0.996875])
    assert sum(1 - look_threshold(0.95, k) for k in range(60)) == pytest.approx(0.05)  # total error budget


def test_holds_until_enough_samples_and_dwell() -> None:
    better, stable = arm(150, 0.6), arm(150, 0.3)
    v = decide(better, stable, dwell_seconds=1e6, last_look=-1, rules=RULES)
    assert (v.action, v.evaluated) == ("hold", False) and "collecting samples: 150 of 200" in v.reason
    v = decide(arm(250, 0.6), arm(250, 0.3), dwell_seconds=59, last_look=-1, rules=RULES)
    assert (v.action, v.evaluated) == ("hold", False) and v.reason.startswith("dwell")
    v = decide(arm(250, 0.6), arm(250, 0.3), dwell_seconds=60, last_look=-1, rules=RULES)
    assert (v.action, v.evaluated, v.look) == ("promote", True, 0)
    v = decide(arm(390, 0.6), arm(390, 0.3), dwell_seconds=60, last_look=0, rules=RULES)
    assert (v.action, v.evaluated) == ("hold", False) and "next look at 400" in v.reason


def test_promote_rollback_and_hysteresis_band() -> None:
    stable = arm(1000, 0.30)
    assert decide(arm(1000, 0.36), stable, 1e6, -1, RULES).action == "promote"
    assert decide(arm(1000, 0.24), stable, 1e6, -1, RULES).action == "rollback"
    # between the bars: P(better) = 0.83 is neither past 0.975 nor below 0.025 -> hold
    v = decide(arm(1000, 0.32), stable, 1e6, -1, RULES)
    assert v.action == "hold" and "within noise" in v.reason and 0.8 < v.p_accept_rate < 0.975


def test_canary_keeps_a_within_noise_candidate_at_the_last_look_only_without_a_sign_of_regression() -> None:
    """`on_inconclusive: promote` (the default): at the last look a hold whose live point estimates are not worse is
    kept, saying it is no proven win; before the last look, with a worse point estimate, with a guardrail broken,
    or under `supersede`, it stays a hold (the controller then lets a newer version supersede it)."""
    rules = DecisionRules(min_samples=50, min_dwell_seconds=0, max_looks=1)
    stable = arm(100, 0.06)
    slightly_better, slightly_worse = arm(100, 0.08), arm(100, 0.05)
    # look 0 (50..99 shown per arm): within noise, not the last look
    assert decide_canary(arm(60, 0.08), arm(60, 0.06), 1e6, -1, rules).action == "hold"
    v = decide_canary(slightly_better, stable, 1e6, 0, rules)
    assert decide(slightly_better, stable, 1e6, 0, rules).action == "hold"  # the same figures: no proven win
    assert (v.action, v.look) == ("promote", 1) and 0.5 <= v.p_accept_rate < 0.9875
    assert v.reason.startswith("kept at the last look (1, 100 shown per arm): passed the eval gate")
    assert "not a proven win" in v.reason
    assert decide_canary(slightly_better, stable, 1e6, 0, rules, gated=False).reason.count("no eval gate") == 1
    v = decide_canary(slightly_worse, stable, 1e6, 0, rules)
    assert v.action == "hold" and v.p_accept_rate < 0.5 and "within noise" in v.reason
    supersede = DecisionRules(min_samples=50, min_dwell_seconds=0, max_looks=1, on_inconclusive="supersede")
    assert decide_canary(slightly_better, stable, 1e6, 0, supersede).action == "hold"
    # quieter: a better accept rate, but shown on 80 of 110 requests against 100 of 100 (suggestion-rate floor 0.8)
    quiet = ArmStats(shown=100, accepted=8, rejected=92, served=130)
    v = decide_canary(quiet, stable, 1e6, 0, rules)
    assert v.action == "hold" and v.breaches and "guardrail broken" in v.reason


def test_quieter_policy_rolled_back_on_yield_not_promoted_on_rate() -> None:
    """Accept rate 0.40 vs 0.30, but shown on half the requests: 20 vs 30 accepted per 100 requests."""
    quiet = ArmStats(shown=1000, accepted=400, rejected=600, empty=1000, served=2000)
    stable = ArmStats(shown=2000, accepted=600, rejected=1400, served=2000)
    v = decide(quiet, stable, 1e6, -1, RULES)
    assert v.p_accept_rate > 0.99 and v.p_yield < 0.01
    assert v.action == "rollback" and "accepted per 100 requests worse" in v.reason
    assert v.figures()["candidate"]["accepted_per_100"] == 20.0


def test_more_suggestions_at_same_accept_rate_is_promoted() -> None:
    """Same accept rate, shown twice as often: accepted per 100 requests is credibly better."""
    eager = ArmStats(shown=2000, accepted=600, served=2000)
    stable = ArmStats(shown=1000, accepted=300, empty=1000, served=2000)
    v = decide(eager, stable, 1e6, -1, RULES)
    assert v.action == "promote" and "accepted per 100 requests better" in v.reason


def test_counters_since_baseline() -> None:
    now = ArmStats.from_mapping({b"shown": b"500", b"accepted": b"160", b"served": b"520", b"other": b"1"})
    base = ArmStats.from_mapping({"shown": "100", "accepted": "30", "served": "100"})
    assert now.minus(base) == ArmStats(shown=400, accepted=130, served=420)
    assert ArmStats.from_mapping(None) == ArmStats()


def chars_arm(shown: int, accepted: int, length: int, served: int | None = None) -> ArmStats:
    """Counters with every shown suggestion ``length`` characters long."""
    return ArmStats(
        shown=shown,
        accepted=accepted,
        rejected=shown - accepted,
        served=served or shown,
        shown_chars=shown * length,
        accepted_chars=accepted * length,
    )


def test_shorter_and_more_accepted_but_fewer_accepted_chars_is_not_promoted() -> None:
    """Reward hacking by brevity: accept rate 0.40 vs 0.30 (credibly better, yield too), suggestions 40 vs 60
    characters: 1600 vs 1800 accepted characters per 100 requests, below the 0.9 floor. Held at every look, never
    promoted; rolled back once the shortfall is credible."""
    stable = chars_arm(1000, 300, 60)
    short = chars_arm(1000, 400, 40)
    assert (short.accept_rate, short.accepted_per_100) > (stable.accept_rate, stable.accepted_per_100)
    assert short.accepted_chars_per_100 == 1600.0 and stable.accepted_chars_per_100 == 1800.0
    last_look, streak = -1, 0
    for n in (1000, 2000, 4000, 8000):
        v = decide(chars_arm(n, n * 4 // 10, 40), chars_arm(n, n * 3 // 10, 60), 1e6, last_look, RULES, streak)
        assert v.p_accept_rate > 0.999  # without the guardrail every one of these looks would promote
        assert v.action == "hold" and v.evaluated, v.reason
        assert "accepted chars per 100 requests 1600.0 < 0.9 x stable 1800.0" in v.reason
        last_look, streak = v.look, v.breach_looks
    assert v.figures()["candidate"]["accepted_chars_per_100"] == 1600.0 and streak == 4
    # shorter still (30 chars: 1200 per 100 requests): the shortfall is credible at once -> rollback
    v = decide(chars_arm(1000, 400, 30), stable, 1e6, -1, RULES)
    assert v.action == "rollback" and v.reason.startswith("guardrail broken: accepted chars per 100 requests 1200.0")
    # the same candidate at a length that keeps its accepted characters above the floor is promoted
    assert decide(chars_arm(1000, 400, 50), stable, 1e6, -1, RULES).action == "promote"


@pytest.mark.parametrize(
    ("candidate", "figure"),
    [
        (ArmStats(shown=600, accepted=300, served=1000, shown_chars=24000, accepted_chars=12000), "suggestion rate"),
        (ArmStats(shown=1000, accepted=450, served=1000, shown_chars=19000, accepted_chars=12000), "mean shown length"),
        (ArmStats(shown=1000, accepted=400, empty=250, served=1250, shown_chars=40000, accepted_chars=16000), "empty"),
    ],
)
def test_each_guardrail_blocks_promotion(candidate: ArmStats, figure: str) -> None:
    """Each candidate has the better accept rate; a clear breach of one guardrail rolls it back (mean length: holds
    at the first look, rolls back at the next), naming the figure."""
    stable = ArmStats(shown=1000, accepted=300, empty=10, served=1010, shown_chars=40000, accepted_chars=12000)
    v = decide(candidate, stable, 1e6, -1, RULES)
    assert candidate.accept_rate > stable.accept_rate and v.p_accept_rate > 0.99
    assert v.action in ("hold", "rollback") and any(b.startswith(figure) for b in v.breaches), v.reason
    assert (v.action == "hold") == (figure == "mean shown length") and figure in v.reason


def test_mean_length_rolls_back_after_breach_looks_and_a_cleared_breach_resets() -> None:
    stable = chars_arm(1000, 300, 60)
    tiny = ArmStats(shown=1000, accepted=900, rejected=100, served=1000, shown_chars=25000, accepted_chars=22500)
    first = decide(tiny, stable, 1e6, -1, RULES)  # 25 chars < 0.5 x 60, but 2250 accepted chars per 100: more
    assert first.action == "hold" and first.breaches == ("mean shown length 25.0 chars < 0.5 x stable 60.0",)
    waiting = decide(tiny, stable, 1, first.look, RULES, first.breach_looks)  # dwell not reached: streak kept
    assert (waiting.evaluated, waiting.breach_looks) == (False, 1)
    again = decide(tiny, chars_arm(1000, 300, 60), 1e6, -1, RULES, first.breach_looks)
    assert again.action == "rollback" and "at 2 consecutive looks" in again.reason
    cleared = decide(chars_arm(2000, 800, 60), chars_arm(2000, 600, 60), 1e6, 0, RULES, breach_looks=1)
    assert cleared.action == "promote" and cleared.breach_looks == 0


def test_character_guardrails_wait_for_character_counts() -> None:
    """Counters without characters (an older feedback service) skip the character guardrails instead of failing."""
    v = decide(arm(1000, 0.36), arm(1000, 0.30), 1e6, -1, RULES)
    assert v.action == "promote" and v.breaches == ()


def test_accepted_length_ratio_is_one_definition_for_counts_and_rates() -> None:
    """The live guardrail (counts) and the eval gate (per 100 requests) ask the same question of the lengths."""
    # stable accepts 40-char suggestions, the candidate 20-char ones: the candidate's yield must be 2x to match
    assert accepted_length_ratio(10, 200.0, 5, 200.0) == pytest.approx(2.0)
    assert accepted_length_ratio(12.5, 250.0, 6.25, 250.0) == pytest.approx(2.0)  # the same as rates per 100
    assert accepted_length_ratio(0, 0.0, 5, 200.0) is None  # nothing accepted: no length to compare
    assert accepted_length_ratio(3, 60.0, 0, 0.0) is None
