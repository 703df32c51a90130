"""The rollout controller against a real valkey, with simulated arms of known accept rates feeding the counters."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import redis

from onlinerl.config import RolloutConfig
from onlinerl.dataplane import holds
from onlinerl.keys import Keys
from onlinerl.loop.status import collect, render
from onlinerl.rollout.records import DecisionRecord
from onlinerl.rollout.store import RolloutStore
from onlinerl.schemas import PolicyTable
from onlinerl_rollout.controller import EvalRequest, RolloutController
from onlinerl_rollout.gate import EvalRecord, GateInput
from tests.rollout.sim import ArmSimulator, Truth, publish_loaded

JOB = "canary"
TICK_SECONDS = 10.0
REQUESTS_PER_TICK = 100


class FakeClock:
    """The controller's clock: dwell is measured in simulated seconds, so the tests need no sleeps."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def good_eval(req: EvalRequest) -> GateInput:
    """An eval where both versions give ordinary code (the gate passes)."""
    recs = [EvalRecord(f"return x + {i}", i % 3 == 0) for i in range(req.samples)]
    return GateInput(req.candidate, req.stable, recs, recs)


def rollout_cfg(**kw) -> RolloutConfig:
    base = dict(strategy="canary", canary_share=0.5, min_samples=200, min_dwell_seconds=60.0)
    return RolloutConfig(**{**base, **kw})


def setup_canary(
    r: redis.Redis, clock: FakeClock, cfg: RolloutConfig, evaluator: Callable = good_eval, hooks: list | None = None
) -> RolloutController:
    """v0 stable, v1 loaded; one tick gates v1 into the canary."""
    r.hset(Keys(JOB).policy, mapping=PolicyTable(stable=0).to_redis())
    publish_loaded(r, JOB, 1)
    ctl = RolloutController(r, JOB, cfg, evaluator, clock=clock, on_decision=hooks or [])
    [rec] = ctl.tick()
    assert rec.decision == "gate_pass" and rec.version == 1
    return ctl


def run_until_decided(
    ctl: RolloutController, sim: ArmSimulator, clock: FakeClock, max_ticks: int
) -> list[DecisionRecord]:
    """Serve and tick until a promote or rollback (or ``max_ticks``); returns every decision recorded."""
    out: list[DecisionRecord] = []
    for _ in range(max_ticks):
        sim.serve(REQUESTS_PER_TICK)
        clock.now += TICK_SECONDS
        out += ctl.tick()
        if out and out[-1].decision in ("promote", "rollback"):
            break
    return out


def policy(r: redis.Redis) -> PolicyTable:
    return PolicyTable.from_redis(r.hgetall(Keys(JOB).policy))


@pytest.mark.parametrize(
    ("candidate_rate", "expected", "expected_samples"),
    # better: look 3 (1613 samples) is held, its promote resting on one user of the candidate arm; look 4 promotes
    [(0.36, "promote", 3202), (0.24, "rollback", 848)],
    ids=["better-promoted", "worse-rolled-back"],
)
def test_better_candidate_promoted_worse_rolled_back(redis_client, candidate_rate, expected, expected_samples) -> None:
    clock, seen = FakeClock(), []
    cfg = rollout_cfg()
    ctl = setup_canary(redis_client, clock, cfg, hooks=[seen.append])
    sim = ArmSimulator(redis_client, JOB, {0: Truth(0.30), 1: Truth(candidate_rate)}, seed=7)
    decisions = run_until_decided(ctl, sim, clock, max_ticks=400)

    final = decisions[-1]
    assert final.decision == expected, [d.reason for d in decisions]
    # the number of samples (shown suggestions in the smaller arm) the decision took, for this seed
    assert final.figures["samples"] == expected_samples
    assert all(d.decision == "hold" for d in decisions[:-1])  # only holds at earlier looks
    table = policy(redis_client)
    assert table.candidate is None and table.canary_share == 0.0
    assert table.stable == (1 if expected == "promote" else 0)
    store = RolloutStore(redis_client, Keys(JOB))
    assert store.state(1).state == ("promoted" if expected == "promote" else "rolled_back")
    # recorded everywhere: stream (with figures), metric, hook
    stream = [d for _, d in store.decisions(50)]
    assert [d.decision for d in stream] == ["gate_pass", *[d.decision for d in decisions]]
    assert stream[-1].figures["candidate"]["shown"] >= expected_samples
    assert [d.decision for d in seen] == [d.decision for d in stream]
    assert ctl.metrics.decisions.labels(expected)._value.get() == 1
    assert ctl.metrics.decisions.labels("gate_pass")._value.get() == 1
    # final: further traffic and ticks change nothing
    for _ in range(20):
        sim.serve(REQUESTS_PER_TICK)
        clock.now += TICK_SECONDS
        assert ctl.tick() == []
    assert policy(redis_client).stable == table.stable


def test_holds_when_within_noise(redis_client) -> None:
    clock = FakeClock()
    ctl = setup_canary(redis_client, clock, rollout_cfg())
    sim = ArmSimulator(redis_client, JOB, {0: Truth(0.30), 1: Truth(0.30)}, seed=11)
    decisions = run_until_decided(ctl, sim, clock, max_ticks=140)  # 14000 requests, ~7000 per arm

    # one recorded hold per look (200, 400, ..., 6400 shown per arm), never a verdict
    assert [d.decision for d in decisions] == ["hold"] * 6
    assert [d.figures["look"] for d in decisions] == [0, 1, 2, 3, 4, 5]
    assert [d.figures["samples"] for d in decisions] == [288, 437, 810, 1643, 3217, 6405]
    # an equal candidate's point figures dip below a guardrail floor now and then: that holds, never rolls back
    assert all("within noise" in d.reason or "guardrail broken, not promoted" in d.reason for d in decisions)
    assert policy(redis_client).candidate == 1  # the canary keeps running


def test_quiet_candidate_cannot_win_by_accept_rate(redis_client) -> None:
    """Higher accept rate (0.42 vs 0.30) but silent on half the requests: fewer accepted per 100 -> rollback."""
    clock = FakeClock()
    ctl = setup_canary(redis_client, clock, rollout_cfg())
    sim = ArmSimulator(redis_client, JOB, {0: Truth(0.30), 1: Truth(0.42, show_rate=0.5)}, seed=3)
    decisions = run_until_decided(ctl, sim, clock, max_ticks=200)
    assert decisions[-1].decision == "rollback"
    assert "accepted per 100 requests worse" in decisions[-1].reason
    fig = decisions[-1].figures
    assert fig["candidate"]["accept_rate"] > fig["stable"]["accept_rate"]
    assert fig["candidate"]["accepted_per_100"] < fig["stable"]["accepted_per_100"]


def test_dwell_time_is_honoured(redis_client) -> None:
    """A large effect has enough samples after a few ticks, but no verdict comes before min_dwell_seconds."""
    clock = FakeClock()
    cfg = rollout_cfg(min_dwell_seconds=600.0)
    ctl = setup_canary(redis_client, clock, cfg)
    started = clock.now
    sim = ArmSimulator(redis_client, JOB, {0: Truth(0.30), 1: Truth(0.60)}, seed=5)
    decisions = run_until_decided(ctl, sim, clock, max_ticks=200)
    assert [d.decision for d in decisions] == ["promote"]
    assert decisions[0].at - started >= 600.0
    assert decisions[0].at - started < 600.0 + 2 * TICK_SECONDS
    assert decisions[0].figures["samples"] > 8 * cfg.min_samples  # samples were there long before the dwell ended


def test_pause_blocks_promotion_pin_freezes_canary(redis_client) -> None:
    from onlinerl.rollout import manual

    clock = FakeClock()
    ctl = setup_canary(redis_client, clock, rollout_cfg())
    store = RolloutStore(redis_client, Keys(JOB))
    sim = ArmSimulator(redis_client, JOB, {0: Truth(0.30), 1: Truth(0.60), 2: Truth(0.30)}, seed=9)
    manual.set_paused(store, True)
    decisions = run_until_decided(ctl, sim, clock, max_ticks=30)
    # recorded once per look (not once per tick), never promoted
    assert [d.decision for d in decisions] == ["hold"] * 3
    assert [d.figures["look"] for d in decisions] == [0, 1, 2]
    assert all(d.reason.startswith("paused: would promote") for d in decisions)
    assert policy(redis_client).stable == 0

    publish_loaded(redis_client, JOB, 2)
    manual.pin(store, 2)  # everyone on v2: the canary gets no traffic and no verdict
    manual.set_paused(store, False)
    assert run_until_decided(ctl, sim, clock, max_ticks=10) == []
    manual.pin(store, None)
    decisions = run_until_decided(ctl, sim, clock, max_ticks=10)
    assert decisions[-1].decision == "promote"
    assert policy(redis_client).stable == 1
    kinds = [d.decision for _, d in store.decisions(50)]
    assert kinds == ["gate_pass", "pause", "hold", "hold", "hold", "pin", "resume", "unpin", "promote"]


def test_no_flapping_under_noisy_results(redis_client) -> None:
    """Candidates as good as stable, in a long noisy stream: the raw difference flips sign again and again, but each
    candidate gets at most one verdict and stable never goes back."""
    clock = FakeClock()
    cfg = rollout_cfg(min_samples=100, min_dwell_seconds=30, on_inconclusive="supersede")
    ctl = setup_canary(redis_client, clock, cfg)
    truth = {v: Truth(0.30) for v in range(8)}
    sim = ArmSimulator(redis_client, JOB, truth, seed=21)
    store = RolloutStore(redis_client, Keys(JOB))
    sign_flips, last_sign, decisions, stables = 0, 0, [], [0]
    for tick in range(300):
        if tick % 50 == 49:  # the trainer keeps publishing
            publish_loaded(redis_client, JOB, 2 + tick // 50)
        sim.serve(REQUESTS_PER_TICK)
        clock.now += TICK_SECONDS
        decisions += ctl.tick()
        table = policy(redis_client)
        if table.stable != stables[-1]:
            stables.append(table.stable)
        if table.candidate is not None:
            c = store.arm_stats(table.candidate, "candidate")
            s = store.arm_stats(table.stable, "stable")
            sign = (c.accept_rate > s.accept_rate) - (c.accept_rate < s.accept_rate)
            sign_flips += sign != last_sign and last_sign != 0
            last_sign = sign
    verdicts = [d for d in decisions if d.decision in ("promote", "rollback", "supersede")]
    assert len(verdicts) == len({d.version for d in verdicts})  # at most one final decision per version
    assert stables == [0]  # stable never moved: no candidate was credibly better
    assert sign_flips >= 10, sign_flips  # the raw difference flipped sign again and again
    kinds = ("gate_pass", "hold", "promote", "rollback", "supersede")
    counts = {k: sum(d.decision == k for d in decisions) for k in kinds}
    # 5 candidates gated in turn (v1 before the loop); each held at every look; an inconclusive one yields to a
    # newer version; v5 was skipped (v6 was already loaded when the canary freed up)
    assert counts == {"gate_pass": 4, "hold": 29, "promote": 0, "rollback": 0, "supersede": 5}


def test_gate_stops_empty_and_degenerate_candidates(redis_client) -> None:
    """v1 emits nothing, v2 loops; both stop at the gate (the trainer keeps going); v3 is fine and becomes candidate."""
    outputs = {
        0: lambda i: f"total += values[{i}]" if i % 4 else "",
        1: lambda i: "",
        2: lambda i: "x = x\n" * 12,
        3: lambda i: f"count = len(items) - {i}",
    }

    def evaluator(req: EvalRequest) -> GateInput:
        def records(v: int) -> list[EvalRecord]:
            return [EvalRecord(outputs[v](i), i % 3 == 0 and bool(outputs[v](i))) for i in range(req.samples)]

        return GateInput(req.candidate, req.stable, records(req.candidate), records(req.stable))

    clock = FakeClock()
    redis_client.hset(Keys(JOB).policy, mapping=PolicyTable(stable=0).to_redis())
    ctl = RolloutController(redis_client, JOB, rollout_cfg(), evaluator, clock=clock)
    store = RolloutStore(redis_client, Keys(JOB))
    got = []
    for v in (1, 2, 3):
        publish_loaded(redis_client, JOB, v)
        got += ctl.tick()
    assert [(d.decision, d.version) for d in got] == [("gate_fail", 1), ("gate_fail", 2), ("gate_pass", 3)]
    assert "empty rate 1.000 > max 0.9" in got[0].reason
    assert "repetition rate" in got[1].reason
    assert got[1].figures["candidate"]["repetition_rate"] > 0.5
    assert {v: s.state for v, s in store.states().items()} == {1: "gate_failed", 2: "gate_failed", 3: "canary"}
    assert policy(redis_client).candidate == 3
    assert ctl.metrics.decisions.labels("gate_fail")._value.get() == 2


def test_evaluator_errors_retry_then_fail(redis_client) -> None:
    calls = []

    def broken(req: EvalRequest) -> GateInput:
        calls.append(req)
        raise ConnectionError("serving unreachable")

    redis_client.hset(Keys(JOB).policy, mapping=PolicyTable(stable=0).to_redis())
    publish_loaded(redis_client, JOB, 1)
    clock = FakeClock()
    ctl = RolloutController(redis_client, JOB, rollout_cfg(), broken, clock=clock, gate_attempts=3)
    store = RolloutStore(redis_client, Keys(JOB))
    assert ctl.tick() == [] and len(calls) == 1
    # `onlinerl status` says why nothing moves: the gate is backing off, with the error and the time left
    note = "eval gate of v1 failed 1 of 3 times (serving unreachable); next attempt in 2s"
    assert store.activity() == (note, clock.now)
    assert f"rollout controller: {note}" in render(collect(redis_client, JOB))
    clock.now += 1.0
    assert ctl.tick() == [] and len(calls) == 1  # retries are spaced in time (2 s, then 4 s), not in ticks
    assert store.activity()[0].endswith("next attempt in 1s")
    clock.now += 1.0
    assert ctl.tick() == [] and len(calls) == 2
    clock.now += 4.0
    [rec] = ctl.tick()
    assert rec.decision == "gate_fail" and "evaluator failed 3 times: serving unreachable" in rec.reason
    assert len(calls) == 3 and calls[0].samples == 64
    assert store.activity()[0] == "" and "rollout controller:" not in render(collect(redis_client, JOB))


def test_status_shows_the_gate_while_it_runs_and_a_paused_wait(redis_client) -> None:
    """A gate takes minutes on CPU: meanwhile `onlinerl status` says which versions it compares, and since when."""
    store = RolloutStore(redis_client, Keys(JOB))
    during = []

    def watching(req: EvalRequest) -> GateInput:
        during.append(store.activity())
        return good_eval(req)

    redis_client.hset(Keys(JOB).policy, mapping=PolicyTable(stable=0, paused=True).to_redis())
    publish_loaded(redis_client, JOB, 1)
    clock = FakeClock()
    ctl = RolloutController(redis_client, JOB, rollout_cfg(), watching, clock=clock)
    assert ctl.tick() == [] and during == []
    assert store.activity()[0] == "paused: v1 waits for `onlinerl policy resume` to be gated"
    redis_client.hset(Keys(JOB).policy, "paused", "0")
    [rec] = ctl.tick()
    assert rec.decision == "gate_pass"
    assert during == [("eval gate running: v1 vs stable v0 on 64 held-out samples", clock.now)]
    assert store.activity()[0] == ""  # the canary's own figures say the rest


def test_stale_decision_never_overwrites_a_manual_rollback(redis_client) -> None:
    """The controller computed a promote for v1, but a human rolled v1 back first: the apply is refused."""
    from onlinerl.rollout import manual

    clock = FakeClock()
    setup_canary(redis_client, clock, rollout_cfg())
    store = RolloutStore(redis_client, Keys(JOB))
    manual.rollback(store)
    stale = DecisionRecord(decision="promote", version=1, stable=0)
    assert store.apply(stale, expect_stable=0, expect_candidate=1, policy={"stable": 1, "candidate": None}) is None
    table = policy(redis_client)
    assert table.stable == 0 and table.candidate is None
    assert store.state(1).state == "rolled_back"
    assert [d.decision for _, d in store.decisions()] == ["gate_pass", "rollback"]


def test_pause_never_keeps_a_worse_candidate(redis_client) -> None:
    """Pausing stops promotions, not safety: a credibly worse candidate is still rolled back."""
    from onlinerl.rollout import manual

    clock = FakeClock()
    ctl = setup_canary(redis_client, clock, rollout_cfg())
    manual.set_paused(RolloutStore(redis_client, Keys(JOB)), True)
    sim = ArmSimulator(redis_client, JOB, {0: Truth(0.30), 1: Truth(0.10)}, seed=2)
    decisions = run_until_decided(ctl, sim, clock, max_ticks=30)
    assert [d.decision for d in decisions] == ["rollback"]
    assert policy(redis_client).candidate is None and policy(redis_client).paused


def test_stable_counts_start_with_the_canary(redis_client) -> None:
    """Stable's counters from before the canary are not compared: the baseline is snapshotted atomically."""
    redis_client.hset(Keys(JOB).policy, mapping=PolicyTable(stable=0).to_redis())
    sim = ArmSimulator(redis_client, JOB, {0: Truth(0.30), 1: Truth(0.30)}, seed=4)
    sim.serve(1000)  # stable-only traffic before v1 exists
    before = RolloutStore(redis_client, Keys(JOB)).arm_stats(0, "stable")
    assert before.served == 1000
    publish_loaded(redis_client, JOB, 1)
    clock = FakeClock()
    ctl = RolloutController(redis_client, JOB, rollout_cfg(min_dwell_seconds=0), good_eval, clock=clock)
    ctl.tick()
    state = RolloutStore(redis_client, Keys(JOB)).state(1)
    assert state.state == "canary" and int(state.baseline["served"]) == 1000
    assert int(state.baseline["shown"]) == before.shown and int(state.baseline["accepted"]) == before.accepted
    served = sim.serve(600)
    clock.now += TICK_SECONDS
    [hold] = ctl.tick()
    assert hold.figures["stable"]["served"] == served[(0, "stable")]  # only what came after the start
    assert hold.figures["candidate"]["served"] == served[(1, "candidate")]


def test_the_gate_holds_both_versions_loaded_while_it_evaluates(redis_client) -> None:
    """On CPU a gate's eval takes minutes while the trainer keeps publishing: both versions are held (the reloader
    keeps them loaded past keepVersions, the trainer never prunes them) until the verdict, then released; an
    `onlinerl eval` hold on the same version survives the release."""
    keys = Keys(JOB)
    redis_client.hset(keys.policy, mapping=PolicyTable(stable=2).to_redis())
    publish_loaded(redis_client, JOB, 2)
    publish_loaded(redis_client, JOB, 3)
    holds.hold(redis_client, keys, [3])  # someone's `onlinerl eval` compares v3 too
    seen: list[set[int]] = []

    def evaluator(req: EvalRequest) -> GateInput:
        seen.append(holds.read(redis_client, keys))
        if len(seen) == 1:
            raise RuntimeError("engine busy")  # an evaluator error: released too, retried later
        return good_eval(req)

    clock = FakeClock()
    ctl = RolloutController(redis_client, JOB, rollout_cfg(), evaluator, clock=clock, gate_retry_seconds=1.0)
    assert ctl.tick() == []
    assert seen == [{2, 3}] and holds.read(redis_client, keys) == {3}  # the gate's released, eval's kept
    clock.now += 5
    [rec] = ctl.tick()
    assert rec.decision == "gate_pass" and seen[1] == {2, 3}
    assert redis_client.hgetall(keys.holds).keys() == {b"3"}  # only the `onlinerl eval` field is left


def test_max_looks_from_the_config_lets_a_newer_version_take_an_undecided_canary(redis_client) -> None:
    """`rollout.maxLooks: 1` (the cpu profile), `onInconclusive: supersede`: an equal candidate held within noise at
    look 1 yields to the newer loaded version with no verdict on its quality; a better one is still promoted by the
    same test."""
    clock = FakeClock()
    cfg = rollout_cfg(min_samples=50, min_dwell_seconds=30, max_looks=1, on_inconclusive="supersede")
    ctl = setup_canary(redis_client, clock, cfg)
    sim = ArmSimulator(redis_client, JOB, {0: Truth(0.30), 1: Truth(0.30), 2: Truth(0.60)}, seed=4)
    publish_loaded(redis_client, JOB, 2)  # the trainer moved on while v1 was in the canary
    decisions = run_until_decided(ctl, sim, clock, max_ticks=60)
    kinds = [(d.decision, d.version) for d in decisions]
    holds = [d for d in decisions if d.decision == "hold" and d.version == 1]
    assert holds and holds[-1].figures["look"] == 1 and holds[-1].reason.startswith("within noise"), kinds
    assert ("supersede", 1) in kinds and "inconclusive after 2 looks" in decisions[kinds.index(("supersede", 1))].reason
    assert kinds[-1] == ("promote", 2) and policy(redis_client).stable == 2


def test_by_default_an_undecided_candidate_without_a_sign_of_regression_is_kept_at_the_last_look(redis_client) -> None:
    """The product's default (`onInconclusive: promote`) with the cpu profile's `maxLooks: 1`: equal candidates, in
    a stream of versions. At the last look each one is kept ("kept ... not a proven win") when its live point
    estimates are not below stable's, else superseded by the newer version; every version gets at most one verdict,
    and a kept version is the stable the next candidate is compared with."""
    clock = FakeClock()
    ctl = setup_canary(redis_client, clock, rollout_cfg(min_samples=50, min_dwell_seconds=30, max_looks=1))
    sim = ArmSimulator(redis_client, JOB, {v: Truth(0.30) for v in range(12)}, seed=6)
    decisions: list[DecisionRecord] = []
    for tick in range(400):
        if tick % 40 == 39:
            publish_loaded(redis_client, JOB, 2 + tick // 40)
        sim.serve(REQUESTS_PER_TICK)
        clock.now += TICK_SECONDS
        decisions += ctl.tick()
    finals = [d for d in decisions if d.decision in ("promote", "rollback", "supersede")]
    assert len(finals) == len({d.version for d in finals}) >= 4
    kept = [d for d in finals if d.decision == "promote"]
    superseded = [d for d in finals if d.decision == "supersede"]
    assert kept and superseded, [(d.decision, d.version, d.reason) for d in finals]
    for d in kept:
        assert d.reason.startswith("kept at the last look (") and "not a proven win" in d.reason, d.reason
        assert d.figures["look"] >= 1
        assert d.figures["p_accept_rate"] >= 0.5 and d.figures["p_yield"] >= 0.5
    for d in superseded:  # a sign of regression, or the drift guard: at most 3 kept promotions in a row (issue 35)
        holds = [h for h in decisions if h.decision == "hold" and h.version == d.version and h.figures]
        last = holds[-1]
        assert min(last.figures["p_accept_rate"], last.figures["p_yield"]) < 0.5 or (
            "not kept: 3 kept promotions in a row" in last.reason
        ), (d.version, last.reason)
    assert len(kept) <= 3  # equal versions never prove a win, so the chain of kept promotions stops at the bound
    assert not [d for d in finals if d.decision == "rollback"]  # an equal candidate is never rolled back on noise
    assert policy(redis_client).stable == kept[-1].version
    assert all(later.stable == earlier.version for earlier, later in itertools.pairwise(kept))
