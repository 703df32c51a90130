"""Kept promotions cannot walk away from the last proven stable (issue 35), written as the drift they stop.

A kept promotion ("within noise, no sign of regression") compares a candidate only with the current stable, so a
chain of them could each be a little worse than the one before. Real valkey, the simulated users served through the
product's own seams (tests/rollout/sim.py: the gateway's record script, feedback's decide and append script), and the
real controller: the chain of kept promotions is written by the controller's own verdict store (``RolloutStore.apply``,
as its promotions write it).
"""

from __future__ import annotations

import redis

from onlinerl.keys import Keys
from onlinerl.rollout.records import ArmStats, DecisionRecord, RolloutState
from onlinerl.rollout.store import RolloutStore
from onlinerl.schemas import PolicyTable
from onlinerl_rollout.controller import RolloutController
from onlinerl_rollout.decision import DecisionRules, DriftGuard, Verdict, drift_block
from tests.rollout.sim import ArmSimulator, Truth, publish_loaded
from tests.rollout.test_controller import REQUESTS_PER_TICK, TICK_SECONDS, FakeClock, good_eval, rollout_cfg

JOB = "canary"


def kept_chain(r: redis.Redis, versions: list[int], kept: bool = True) -> None:
    """``versions`` promoted one after the other from v0, each kept (not a proven win) unless ``kept`` is False;
    the last one is stable."""
    store, previous = RolloutStore(r, Keys(JOB)), 0
    for v in versions:
        state = RolloutState(version=v, state="promoted", previous_stable=previous, kept=kept, reason="test chain")
        rec = DecisionRecord(decision="promote", version=v, stable=previous, reason="test chain")
        assert store.apply(rec, policy={"stable": v, "candidate": None, "canary_share": 0.0}, states=[state])
        publish_loaded(r, JOB, v)
        previous = v


def run_canary(r: redis.Redis, clock: FakeClock, ctl: RolloutController, sim: ArmSimulator, candidate: int):
    publish_loaded(r, JOB, candidate)
    decisions = ctl.tick()
    assert [(d.decision, d.version) for d in decisions] == [("gate_pass", candidate)]
    for _ in range(60):
        sim.serve(REQUESTS_PER_TICK)
        clock.now += TICK_SECONDS
        decisions += [d for d in ctl.tick() if d.figures]
        if decisions[-1].decision in ("promote", "rollback") or decisions[-1].figures.get("look", -1) >= 1:
            return decisions[-1]
    raise AssertionError("no last look")


def test_a_fourth_kept_promotion_in_a_row_is_refused(redis_client) -> None:
    """v1..v3 were each kept (within noise of the one before); v4 is within noise of v3 too, and better on the
    point estimates. The default bound (3 kept in a row) refuses to keep it: only a proven win moves stable now."""
    truths = {v: Truth(0.30) for v in range(5)} | {4: Truth(0.36)}
    for bound, expected in ((3, "hold"), (4, "promote")):
        redis_client.flushall()
        redis_client.hset(Keys(JOB).policy, mapping=PolicyTable(stable=0).to_redis())
        kept_chain(redis_client, [1, 2, 3])
        clock = FakeClock()
        cfg = rollout_cfg(min_samples=50, min_dwell_seconds=30, max_looks=1, max_kept_in_a_row=bound)
        ctl = RolloutController(redis_client, JOB, cfg, good_eval, clock=clock)
        last = run_canary(redis_client, clock, ctl, ArmSimulator(redis_client, JOB, truths, seed=3), 4)
        assert last.decision == expected, last.reason
        if expected == "hold":
            assert "not kept: 3 kept promotions in a row since the last proven stable v0" in last.reason
            assert ctl.store.policy().stable == 3
        else:
            assert last.reason.startswith("kept at the last look") and ctl.store.policy().stable == 4
            assert ctl.store.state(4).kept is True  # the next candidate's chain counts it


def test_a_kept_promotion_credibly_worse_than_the_last_proven_stable_is_refused(redis_client) -> None:
    """v0 (the base) accepted 45 % of 1,500 suggestions as stable. v1 was kept at 30 % (its canary's noise let it
    through), and v2 is within noise of v1 but credibly worse than v0: not kept. The same v2 after a proven v1 (v1
    is the anchor then) is kept."""
    truths = {0: Truth(0.45), 1: Truth(0.30), 2: Truth(0.33)}
    for kept_v1, expected in ((True, "hold"), (False, "promote")):
        redis_client.flushall()
        redis_client.hset(Keys(JOB).policy, mapping=PolicyTable(stable=0).to_redis())
        sim = ArmSimulator(redis_client, JOB, truths, seed=11)
        sim.serve(1500)  # v0's life as stable
        base = ArmStats.from_mapping(redis_client.hgetall(Keys(JOB).stats(0, "stable")))
        assert base.shown == 1500 and 0.40 < base.accept_rate < 0.50
        kept_chain(redis_client, [1], kept=kept_v1)
        clock = FakeClock()
        ctl = RolloutController(redis_client, JOB, rollout_cfg(min_samples=50, max_looks=1), good_eval, clock=clock)
        last = run_canary(redis_client, clock, ctl, sim, 2)
        assert last.decision == expected, last.reason
        if expected == "hold":
            assert "not kept: credibly worse than the last proven stable v0" in last.reason
            assert ctl.store.policy().stable == 1


def verdict(candidate: ArmStats, look: int = 1) -> Verdict:
    return Verdict("promote", "kept", look, True, 0.6, 0.6, candidate, candidate, kept=True)


def test_drift_block_rules() -> None:
    rules = DecisionRules(min_samples=50, max_kept_in_a_row=2)
    same = ArmStats(shown=200, accepted=60, served=200)
    assert drift_block(verdict(same), None, rules) is None
    assert drift_block(verdict(same), DriftGuard(1, 0, None), rules) is None
    assert "2 kept promotions in a row" in (drift_block(verdict(same), DriftGuard(2, 0, None), rules) or "")
    better_anchor = ArmStats(shown=2000, accepted=900, served=2000)  # 45 % against the candidate's 30 %
    assert "credibly worse" in (drift_block(verdict(same), DriftGuard(1, 0, better_anchor), rules) or "")
    small_anchor = ArmStats(shown=40, accepted=18, served=40)  # under min_samples: not compared
    assert drift_block(verdict(same), DriftGuard(1, 0, small_anchor), rules) is None
    assert drift_block(verdict(same), DriftGuard(1, 0, ArmStats(shown=2000, accepted=640, served=2000)), rules) is None
