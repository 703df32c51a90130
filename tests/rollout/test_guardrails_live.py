"""Guardrails through the real controller and a real valkey: a shorter policy that users accept more often, but
that leaves them fewer accepted characters, is held, then rolled back, never promoted; the reason reaches the
decision stream, the ``on_decision`` hooks (the operator's Events) and ``onlinerl status``."""

from __future__ import annotations

from onlinerl.loop.status import collect, render
from onlinerl.rollout.records import DecisionRecord
from tests.rollout.sim import ArmSimulator, Truth
from tests.rollout.test_controller import JOB, FakeClock, rollout_cfg, setup_canary


def test_shorter_more_accepted_fewer_chars_is_rolled_back_with_reason_in_status(redis_client) -> None:
    clock, seen = FakeClock(), []
    ctl = setup_canary(redis_client, clock, rollout_cfg(min_samples=100, min_dwell_seconds=0.0), hooks=[seen.append])
    # v1 is accepted 45 % vs 30 %, but its suggestions are 24 vs 60 characters: 1080 vs 1800 accepted chars / 100
    sim = ArmSimulator(redis_client, JOB, {0: Truth(0.30, length=60), 1: Truth(0.45, length=24)}, seed=3)
    decided: list[DecisionRecord] = []
    status_mid = ""
    for _ in range(200):
        sim.serve(50)
        decided += ctl.tick()
        if not status_mid and ctl.store.arm_stats(1, "candidate").shown > 50:
            status_mid = render(collect(redis_client, JOB))
        if any(d.decision in ("promote", "rollback") for d in decided):
            break
    kinds = [d.decision for d in decided]
    assert "promote" not in kinds and kinds[-1] == "rollback", kinds
    rollback = decided[-1]
    assert rollback.reason.startswith("guardrail broken: accepted chars per 100 requests")
    assert rollback.figures["candidate"]["accept_rate"] > rollback.figures["stable"]["accept_rate"]
    assert (
        rollback.figures["candidate"]["accepted_chars_per_100"]
        < 0.9 * rollback.figures["stable"]["accepted_chars_per_100"]
    )
    assert [d.decision for d in seen][-1] == "rollback" and seen[-1].reason == rollback.reason

    # status while the canary ran: both arms' figures, guardrails included, and the hold with its reason
    assert "canary: v1 vs stable v0" in status_mid
    for label in ("accept rate", "suggestion rate", "accepted chars/100 req", "mean shown length", "empty rate"):
        assert label in status_mid
    assert "last eval gate: v1 vs v0 passed" in status_mid and "repetition rate" in status_mid
    # status afterwards: no canary, the last verdict with its full reason
    after = render(collect(redis_client, JOB))
    assert "canary:" not in after and "last verdict: rollback v1" in after and rollback.reason in after
