"""Blue/green (one version served at a time): the gate, the switch of everyone, the live watch against stable's
snapshot, and keep or automatic switch back. Real valkey; the simulated arms route by the live policy table (share 1:
everyone on the candidate), so the controller reads exactly what the gateway and feedback would write.
tests/rollout/test_e2e_full_weights.py takes the same decisions through the real components in full-weight mode."""

from __future__ import annotations

import pytest
import redis

from onlinerl.arms import CANDIDATE, STABLE
from onlinerl.config import ConfigError, RolloutConfig, from_mapping
from onlinerl.keys import Keys
from onlinerl.loop.status import collect, render
from onlinerl.rollout.records import ArmStats
from onlinerl.rollout.store import RolloutStore
from onlinerl.schemas import PolicyTable, PolicyVersionState
from onlinerl_rollout.controller import EvalRequest, RolloutController
from onlinerl_rollout.decision import DecisionRules, Guardrails, decide_watch, watch_last_look
from onlinerl_rollout.gate import EvalRecord, GateInput
from tests.rollout.sim import ArmSimulator, Truth
from tests.rollout.test_controller import FakeClock, good_eval

JOB = "canary"  # ArmSimulator and the helpers of test_controller use this job
MIN_SAMPLES = 100


def ready(r: redis.Redis, version: int) -> None:
    """What the full-weight reloader writes for a verified version it has not swapped in (one version at a time)."""
    from onlinerl.dataplane import versions

    versions.report(r, Keys(JOB), "r-0", [PolicyVersionState(version=version, state="ready")], ttl=3600)


def bluegreen_cfg(**kw) -> RolloutConfig:
    base = dict(strategy="bluegreen", min_samples=MIN_SAMPLES, min_dwell_seconds=30.0)
    return RolloutConfig(**{**base, **kw})


def table(r: redis.Redis) -> PolicyTable:
    return PolicyTable.from_redis(r.hgetall(Keys(JOB).policy))


def watch_until_decided(ctl: RolloutController, sim: ArmSimulator, clock: FakeClock, max_ticks: int = 200) -> list:
    out = []
    for _ in range(max_ticks):
        sim.serve(50)
        clock.now += 10.0
        out += ctl.tick()
        if out and out[-1].decision in ("promote", "rollback", "gate_fail"):
            break
    return out


def switched(r: redis.Redis, truth: dict[int, Truth], evaluator=good_eval, **cfg) -> tuple:
    """v0 stable with a baseline of 800 shown, v1 ready; the controller gates v1 and switches everyone to it."""
    clock = FakeClock()
    r.hset(Keys(JOB).policy, mapping=PolicyTable(stable=0).to_redis())
    sim = ArmSimulator(r, JOB, truth, seed=5)
    ready(r, 1)
    ctl = RolloutController(r, JOB, bluegreen_cfg(**cfg), evaluator, clock=clock)
    sim.serve(800)
    [rec] = ctl.tick()
    return ctl, sim, clock, rec


# --- the decision function (pure) ---------------------------------------------------------------------------------
def test_watch_window_ends_at_the_last_look_the_snapshot_allows() -> None:
    rules = DecisionRules(min_samples=100, min_dwell_seconds=0, guardrails=Guardrails(min_shown_length_ratio=0.5))
    assert [watch_last_look(ArmStats(shown=n), rules) for n in (99, 100, 399, 400, 10**6)] == [-1, 0, 1, 2, 5]
    baseline = ArmStats(shown=400, accepted=120, served=400, shown_chars=16000, accepted_chars=4800)
    equal = ArmStats(shown=200, accepted=61, served=200, shown_chars=8000, accepted_chars=2440)
    early = decide_watch(equal, baseline, 60, 0, rules)  # look 1 of 2: within noise, the watch goes on
    assert (early.action, early.look) == ("hold", 1) and early.reason.startswith("within noise")
    end = decide_watch(ArmStats(shown=800, accepted=241, served=800, shown_chars=32000, accepted_chars=9640),
                       baseline, 60, 1, rules)  # fmt: skip
    assert (end.action, end.look) == ("promote", 2) and end.reason.startswith("kept: no live regression")
    # the same end with the mean shown length under its floor: switch back, not keep
    short = ArmStats(shown=800, accepted=241, served=800, shown_chars=8000, accepted_chars=2410)
    v = decide_watch(short, baseline, 60, 1, rules, breach_looks=0)
    assert v.action == "rollback" and "guardrail" in v.reason


def test_worse_candidate_is_switched_back_before_the_window_ends() -> None:
    rules = DecisionRules(min_samples=100, min_dwell_seconds=0)
    baseline = ArmStats(shown=3200, accepted=960, served=3200)  # window up to look 5
    worse = ArmStats(shown=100, accepted=5, served=100)
    v = decide_watch(worse, baseline, 60, -1, rules)
    assert (v.action, v.look) == ("rollback", 0) and "accept rate worse" in v.reason


# --- the controller on a real valkey --------------------------------------------------------------------------------
def test_switch_waits_for_stable_baseline_then_gives_everyone_the_candidate(redis_client) -> None:
    clock = FakeClock()
    r = redis_client
    r.hset(Keys(JOB).policy, mapping=PolicyTable(stable=0).to_redis())
    sim = ArmSimulator(r, JOB, {0: Truth(0.30), 1: Truth(0.30)}, seed=1)
    ready(r, 1)
    ctl = RolloutController(r, JOB, bluegreen_cfg(), good_eval, clock=clock)
    sim.serve(50)  # ~50 shown on v0's arm: below minSamples, the watch could never look
    assert ctl.tick() == [] and table(r).candidate is None
    assert ctl.doing.startswith("v1 waits for stable v0's baseline") and f"of {MIN_SAMPLES} shown" in ctl.doing
    assert f"rollout controller: {ctl.doing} (since " in render(collect(r, JOB))  # not only in the log
    sim.serve(100)
    [rec] = ctl.tick()
    assert rec.decision == "gate_pass" and rec.figures["canary_share"] == 1.0
    t = table(r)
    assert (t.candidate, t.canary_share, t.stable) == (1, 1.0, 0)
    state = RolloutStore(r, Keys(JOB)).state(1)
    assert int(state.baseline["shown"]) == RolloutStore(r, Keys(JOB)).arm_stats(0, STABLE).shown >= MIN_SAMPLES
    served = sim.serve(200)
    assert set(served) == {(1, CANDIDATE)}  # everyone on the candidate, labelled candidate
    assert ctl.metrics.all_traffic._value.get() == 0  # no tick judged yet
    ctl.tick()
    assert ctl.metrics.all_traffic._value.get() == 1


@pytest.mark.parametrize(
    ("rate", "expected", "reason"),
    [(0.45, "promote", "accept rate better"), (0.30, "promote", "kept: no live regression"),
     (0.15, "rollback", "accept rate worse")],
    ids=["better-kept", "equal-kept-at-window-end", "worse-switched-back"],
)  # fmt: skip
def test_watch_keeps_or_switches_back(redis_client, rate, expected, reason) -> None:
    r = redis_client
    seen = []
    ctl, sim, clock, _ = switched(r, {0: Truth(0.30), 1: Truth(rate)})
    ctl.on_decision.append(seen.append)
    decisions = watch_until_decided(ctl, sim, clock)
    final = decisions[-1]
    assert final.decision == expected and reason in final.reason, [d.reason for d in decisions]
    assert all(d.decision == "hold" for d in decisions[:-1])
    assert final.figures["stable"]["shown"] == int(RolloutStore(r, Keys(JOB)).state(1).baseline["shown"])
    t = table(r)
    assert (t.candidate, t.canary_share) == (None, 0.0)  # the reloader swaps back (rollback) or keeps v1 (stable)
    assert t.stable == (1 if expected == "promote" else 0)
    assert RolloutStore(r, Keys(JOB)).state(1).state == ("promoted" if expected == "promote" else "rolled_back")
    assert seen[-1].decision == expected  # the operator's Event hook got it
    shown = final.figures["candidate"]["shown"]
    print(f"\n{expected} v1 (true accept rate {rate}) after {shown} shown: {final.reason}")


def test_quieter_candidate_is_switched_back(redis_client) -> None:
    """Accepted more often when it speaks, but silent on half the requests: fewer accepted per 100 requests."""
    ctl, sim, clock, _ = switched(redis_client, {0: Truth(0.30), 1: Truth(0.42, show_rate=0.5)})
    final = watch_until_decided(ctl, sim, clock)[-1]
    assert final.decision == "rollback" and "accepted per 100 requests worse" in final.reason
    assert final.figures["candidate"]["accept_rate"] > final.figures["stable"]["accept_rate"]


def test_gate_fail_never_switches(redis_client) -> None:
    def degenerate(req: EvalRequest) -> GateInput:
        good = [EvalRecord(f"return x + {i}", i % 3 == 0) for i in range(req.samples)]
        return GateInput(req.candidate, req.stable, [EvalRecord("", False)] * req.samples, good)

    ctl, *_, rec = switched(redis_client, {0: Truth(0.30), 1: Truth(0.30)}, evaluator=degenerate)
    assert rec.decision == "gate_fail"
    assert table(redis_client).candidate is None
    assert ctl.metrics.guardrail_breaches.labels("gate")._value.get() >= 1
    assert ctl.metrics.gate_figure.labels("1", CANDIDATE, "empty_rate")._value.get() == 1.0


def test_canary_does_not_take_ready_versions(redis_client) -> None:
    """``ready`` (full weights, not in vLLM) is for blue/green only: a canary needs the version servable now."""
    r = redis_client
    r.hset(Keys(JOB).policy, mapping=PolicyTable(stable=0).to_redis())
    ready(r, 1)
    ctl = RolloutController(r, JOB, bluegreen_cfg(strategy="canary"), good_eval, clock=FakeClock())
    assert ctl.tick() == [] and table(r).candidate is None


def test_live_figures_exported_for_the_watch(redis_client) -> None:
    from prometheus_client import generate_latest

    ctl, sim, clock, _ = switched(redis_client, {0: Truth(0.30, length=40), 1: Truth(0.30, length=10)})
    sim.serve(150)
    clock.now += 60
    ctl.tick()
    text = generate_latest(ctl.metrics.registry).decode()
    assert 'onlinerl_rollout_live_figure{arm="candidate",figure="mean_shown_length",version="1"} 10.0' in text
    assert 'onlinerl_rollout_live_figure{arm="stable",figure="mean_shown_length",version="0"} 40.0' in text
    assert ctl.metrics.guardrail_breaches.labels("live")._value.get() >= 1  # shorter than 0.5 x stable's
    assert "onlinerl_rollout_candidate_has_all_traffic 1.0" in text


# --- configuration ----------------------------------------------------------------------------------------------------
def test_full_weights_default_to_bluegreen_and_refuse_canary() -> None:
    full = {"serving": {"weightsMode": "full"}, "trainer": {"weights": "full"}}
    assert from_mapping(full).rollout.strategy == "bluegreen"
    assert from_mapping(full).rollout.controlled
    with pytest.raises((ConfigError, ValueError)) as err:
        from_mapping({**full, "rollout": {"strategy": "canary"}})
    assert "rollout.strategy: bluegreen" in str(err.value) and "serving.weightsMode: full" in str(err.value)
    assert from_mapping({**full, "rollout": {"strategy": "direct"}}).rollout.controlled is False
    assert from_mapping({"rollout": {"strategy": "bluegreen"}}).rollout.strategy == "bluegreen"  # LoRA may too


# --- the reloader's target: what vLLM's one model must hold --------------------------------------------------------
def test_full_weight_reloader_holds_the_candidate_only_with_all_traffic() -> None:
    """The reloader and the gateway's ``choose`` read the same table: share 1 puts everyone on the candidate, so vLLM
    holds it; any smaller share (a canary it cannot serve) keeps stable; a failed candidate falls back to stable,
    never to an older unjudged version; a pin wins over everything."""
    import httpx

    from onlinerl_serving.checkpoints import Announcement
    from onlinerl_serving.reloader import Reloader, Version

    cfg = from_mapping({"job": JOB, "serving": {"weightsMode": "full"}})
    rl = Reloader(cfg, None, httpx.AsyncClient(), httpx.AsyncClient())
    for v in (1, 2, 3):
        rl.versions[v] = Version(Announcement(f"{v}-0", v, f"/c/v{v}", "full", ""))
    assert rl.full_target(PolicyTable(stable=1, candidate=3, canary_share=1.0)) == 3
    assert rl.full_target(PolicyTable(stable=1, candidate=3, canary_share=0.5)) == 1
    assert rl.full_target(PolicyTable(stable=1, candidate=3, canary_share=1.0, pinned=2)) == 2
    assert rl.full_target(PolicyTable(stable=1)) == 1
    rl.versions[3].state = "failed"
    assert rl.full_target(PolicyTable(stable=1, candidate=3, canary_share=1.0)) == 1
    assert rl.full_target(PolicyTable(stable=1, candidate=7, canary_share=1.0)) == 1  # never announced here
