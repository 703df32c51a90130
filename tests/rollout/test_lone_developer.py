"""A lone developer sees the loop close (issue 36): one key, under the local stack's defaults, is served the trained
version within minutes, and `onlinerl status` says what the canary waits for meanwhile.

Real controller on a real valkey; the users go through the gateway's route() and feedback's store (tests/rollout/
sim.py), so the one key is split exactly as the gateway splits it, by key and then by request. The controller's clock
is simulated at the local stack's pace (a CPU machine serves a few requests a minute to one person: 30 a minute
here), so "within minutes" is measured in the controller's own seconds, dwell included, with no sleeps. The same
through the real gateway, feedback service and controller processes: tests/rollout/test_e2e_real.py.

The few-user rules must not reopen issue 35 for a crowd: with ``fewUsers: decide`` the one-key attacks still hold
(tests/rollout/test_one_key_cannot_decide.py runs them under both settings).
"""

from __future__ import annotations

from pathlib import Path

from onlinerl.arms import CANDIDATE, STABLE
from onlinerl.config import OnlineRLConfig, RolloutConfig
from onlinerl.keys import Keys
from onlinerl.loop.stack import StackPaths, effective_config
from onlinerl.loop.status import collect, render
from onlinerl.profiles import with_local_profile
from onlinerl.rollout.store import RolloutStore
from onlinerl_rollout.controller import RolloutController
from onlinerl_serving.routing import user_hash, user_point
from tests.rollout.sim import ArmSimulator, Truth, publish_loaded
from tests.rollout.test_controller import JOB, FakeClock, good_eval

TICK = 10.0  # seconds between controller ticks (the controller's default interval is 5 s)
PER_TICK = 5  # one developer on a CPU machine: 30 requests a minute


def local_rollout(tmp: Path) -> RolloutConfig:
    """The rollout section `onlinerl up` runs on this (GPU-less) machine: the product's defaults, the cpu profile and
    the local stack's own settings, computed by the same functions."""
    cfg = with_local_profile(OnlineRLConfig.model_validate({}), has_gpu=False)
    return effective_config(cfg, StackPaths(tmp), "redis://127.0.0.1:1/0", tmp).rollout


def stable_seed() -> int:
    """A simulator seed whose one key the gateway's hash puts on the stable arm of a 0.5 canary."""
    return next(seed for seed in range(100) if user_point(user_hash(f"sk-sim-{seed}-0")) >= 0.5)


def start(redis_client, clock: FakeClock, cfg: RolloutConfig) -> tuple[RolloutController, RolloutStore]:
    """v0 stable, v1 (the trainer's first version) loaded and gated into the canary by the controller's first tick."""
    from onlinerl.schemas import PolicyTable

    redis_client.hset(Keys(JOB).policy, mapping=PolicyTable(stable=0).to_redis())
    publish_loaded(redis_client, JOB, 1)
    ctl = RolloutController(redis_client, JOB, cfg, good_eval, clock=clock)
    assert [d.decision for d in ctl.tick()] == ["gate_pass"]
    return ctl, RolloutStore(redis_client, Keys(JOB))


def test_one_key_under_the_local_defaults_is_served_the_trained_version_within_minutes(redis_client, tmp_path):
    cfg = local_rollout(tmp_path)
    assert (cfg.few_users, cfg.max_user_share, cfg.min_samples, cfg.canary_share) == ("decide", 0.25, 30, 0.5)
    assert cfg.min_dwell_seconds == 120 and cfg.max_looks == 1  # the defaults, dwell included: nothing shortened
    clock = FakeClock()
    ctl, store = start(redis_client, clock, cfg)
    started = clock.now
    # one key, on the stable arm by its hash (the measured case: served v0 for ever); v1 learned something
    sim = ArmSimulator(redis_client, JOB, {0: Truth(0.25), 1: Truth(0.45)}, seed=stable_seed(), users=1)
    served: dict[tuple[int, str], int] = {}
    said: list[str] = []
    first_v1 = None
    while store.policy().stable != 1:
        assert clock.now - started < 15 * 60, f"no promotion in 15 minutes: {store.activity()[0]}"
        for where, n in sim.serve(PER_TICK).items():
            served[where] = served.get(where, 0) + n
            if where[0] == 1 and first_v1 is None:
                first_v1 = clock.now - started
        clock.now += TICK
        ctl.tick()
        said.append(render(collect(redis_client, JOB)))
    promoted_after = clock.now - started

    # Meanwhile `onlinerl status` said what the canary waited for: first the split it was about to change ...
    assert any("the candidate arm has served no request since the canary started" in s for s in said)
    assert any(
        "1 user(s) in this canary, fewer than the 4 a look needs" in s and "splits by request once 30" in s
        for s in said
    )
    # ... then the pooled counts it was collecting, split by request
    assert any("split by request, judged on pooled counters (rollout.fewUsers: decide)" in s for s in said)
    assert any("canary share 0.50 of requests" in s for s in said)

    decisions = [d for _, d in store.decisions(50)]
    split = next(d for d in decisions if d.decision == "hold" and "splits by request" in d.reason)
    assert "30 requests came from 1 user(s), fewer than the 4" in split.reason
    promote = decisions[-1]
    assert (promote.decision, promote.version) == ("promote", 1)
    assert "few-user canary (1 user(s), fewer than 4): judged on pooled counters" in promote.reason
    assert promote.figures["guardrail_breaches"] == [] and promote.figures["samples"] >= 30
    # the key was served both arms once split by request, and every outcome counted in the arm that served it
    assert served.get((1, CANDIDATE), 0) > 0 and served.get((0, STABLE), 0) > 0
    cand = store.arm_stats(1, CANDIDATE)
    assert cand.served == served[(1, CANDIDATE)] and cand.shown == served[(1, CANDIDATE)]
    # after the promotion the key is served v1, and nothing is in canary
    after = sim.serve(20)
    assert after == {(1, STABLE): 20} and store.policy().split == "key"
    assert first_v1 is not None and 60 <= first_v1 <= 3 * 60 and promoted_after <= 10 * 60
    print(
        f"\nlone key: first served v1 after {first_v1:.0f} s, v1 promoted after {promoted_after:.0f} s "
        f"({promote.reason})"
    )


def test_one_key_under_the_product_default_waits_and_says_what_to_set(redis_client, tmp_path):
    """Without the opt-in (rollout.fewUsers: wait, every deployment but `onlinerl up`) a lone key's canary holds: the
    split stays by key, no look is taken, and status names the setting."""
    cfg = local_rollout(tmp_path).model_copy(update={"few_users": "wait"})
    clock = FakeClock()
    ctl, store = start(redis_client, clock, cfg)
    sim = ArmSimulator(redis_client, JOB, {0: Truth(0.25), 1: Truth(0.45)}, seed=stable_seed(), users=1)
    for _ in range(60):  # ten minutes of one developer
        sim.serve(PER_TICK)
        clock.now += TICK
        assert ctl.tick() == []
    table = store.policy()
    assert (table.stable, table.candidate, table.split) == (0, 1, "key")
    text = render(collect(redis_client, JOB))
    assert "arms are split by API key" in text and "this canary never decides" in text
    assert "set rollout.fewUsers: decide to let a lone developer's or a few trusted users' traffic decide" in text


def test_two_users_under_decide_are_judged_on_pooled_counts_and_say_so(redis_client, tmp_path):
    """Two keys (fewer than 4): split by request, then a verdict on the pooled counts whose reason says that no
    per-user rule applied, so a reader of the decision knows what it rests on."""
    cfg = local_rollout(tmp_path).model_copy(update={"min_dwell_seconds": 0.0})
    clock = FakeClock()
    ctl, store = start(redis_client, clock, cfg)
    sim = ArmSimulator(redis_client, JOB, {0: Truth(0.2), 1: Truth(0.6)}, users=2)
    decided = []
    for _ in range(100):
        sim.serve(20)
        clock.now += TICK
        decided += [d for d in ctl.tick() if d.decision in ("promote", "rollback")]
        if decided:
            break
    assert [d.decision for d in decided] == ["promote"]
    assert "few-user canary (2 user(s), fewer than 4)" in decided[0].reason
    assert len(store.arm_users(1, CANDIDATE, 1)) == 2 and len(store.arm_users(0, STABLE, 1)) == 2
