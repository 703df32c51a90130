"""`onlinerl status` says what a canary waits for: the controller's own hold reason and, for a lone developer (one
key, so every request lands in one arm), that the other arm is never served and the canary cannot decide (issue 36).

Real controller on a real valkey; the simulated users go through the gateway's route() and feedback's store
(tests/rollout/sim.py), so the single key is split exactly as the gateway splits it.
"""

from __future__ import annotations

from onlinerl.keys import Keys
from onlinerl.loop.status import collect, render
from onlinerl.rollout.store import RolloutStore
from tests.rollout.sim import ArmSimulator, Truth
from tests.rollout.test_controller import JOB, TICK_SECONDS, FakeClock, rollout_cfg, setup_canary


def test_a_lone_keys_canary_says_the_other_arm_is_never_served(redis_client) -> None:
    clock = FakeClock()
    ctl = setup_canary(redis_client, clock, rollout_cfg(min_samples=30, min_dwell_seconds=0.0))
    store = RolloutStore(redis_client, Keys(JOB))
    sim = ArmSimulator(redis_client, JOB, {0: Truth(0.3), 1: Truth(0.3)}, users=1)
    for _ in range(5):
        sim.serve(40)
        clock.now += TICK_SECONDS
        assert ctl.tick() == []  # one key: one arm only, nothing to compare, no decision
    activity = store.activity()[0]
    assert activity.startswith("canary v1 holds: collecting samples: 0 of 30 shown in the smaller arm"), activity
    assert "arm has served no request since the canary started: arms are split by API key" in activity
    assert f"rollout controller: {activity}" in render(collect(redis_client, JOB))


def test_a_canary_with_both_arms_served_says_only_its_reason(redis_client) -> None:
    clock = FakeClock()
    ctl = setup_canary(redis_client, clock, rollout_cfg(min_samples=400, min_dwell_seconds=0.0))
    store = RolloutStore(redis_client, Keys(JOB))
    sim = ArmSimulator(redis_client, JOB, {0: Truth(0.3), 1: Truth(0.3)}, users=500)
    sim.serve(100)
    clock.now += TICK_SECONDS
    assert ctl.tick() == []
    activity = store.activity()[0]
    assert activity.startswith("canary v1 holds: collecting samples: ") and "split by API key" not in activity
