"""The attack: a human rolls v8 back to v5 under ``canary``, and the next tick gates v9 -- trained on v8's weights --
which may be kept within minutes, undoing the rollback. It must not: the rollback holds the rollout controller (no
version is gated, canaried or promoted until ``onlinerl policy resume``), the trainer rebases onto v5's weights
before it trains again, so the next version descends from v5 and its manifest says so, and a version trained on the
dropped weights (published before the trainer saw the rollback) is never gated, not even after resume.

Real parts: the trainer (``Trainer``: its update, publisher and checkpoint store) on the tiny model, the rollout
controller with its gate, ``onlinerl policy`` and ``onlinerl status`` through the CLI, one real valkey. Only the
serving replica is a stand-in: ``serve`` writes what its reloader writes once it has loaded a version, with the
lineage marker the reloader's own parser reads from the announcement.
"""

from __future__ import annotations

import getpass

import pytest
import torch
from safetensors.torch import load_file

from onlinerl.cli import main
from onlinerl.config import RolloutConfig
from onlinerl.dataplane import versions
from onlinerl.keys import Keys
from onlinerl.loop.status import collect, render
from onlinerl.rollout.records import DecisionRecord, RolloutState
from onlinerl.rollout.store import RolloutStore
from onlinerl.schemas import PolicyVersionState, adapter_name
from onlinerl_rollout.controller import EvalRequest, RolloutController
from onlinerl_serving.checkpoints import Announcement
from onlinerl_trainer.trainer import Trainer
from tests.rollout.evaluators import plain_code
from tests.trainer.conftest import JOB, make_sample, trainer_config, xadd_samples

PROMPT = [1604, 803, 24, 81, 28, 278, 727, 472, 1003, 253, 1232, 278, 198]
ADAPTER = "adapter_model.safetensors"


def serve(r, version: int, rollback_at: float | None = None) -> None:
    """The serving replica has loaded ``version``: its state as the reloader records it, lineage marker included
    (``rollback_at``; None: read from the version's announcement with the reloader's parser)."""
    if rollback_at is None:
        found = [Announcement.from_entry(i, f) for i, f in r.xrange(Keys(JOB).checkpoints)]
        [ann] = [a for a in found if a.version == version]
        rollback_at = ann.rollback_at
    state = PolicyVersionState(
        version=version, state="loaded", served_model=adapter_name(JOB, version), rollback_at=rollback_at
    )
    versions.report(r, Keys(JOB), "sim-0", [state], ttl=3600)


def train_and_serve(trainer: Trainer, r, versions: range | tuple[int, ...]) -> None:
    """One update per version, published, then loaded by serving."""
    for v in versions:
        xadd_samples(r, batch(8 * v, v - 1))
        assert trainer.train_on(trainer.collect()) is not None
        assert trainer.publish() == v
        serve(r, v)


def promoted(store: RolloutStore, version: int, over: int, *others: RolloutState) -> None:
    """``version`` became stable over ``over`` (the rollout's own apply script), with more verdicts if given."""
    store.apply(
        DecisionRecord(decision="promote", version=version, stable=over),
        policy={"stable": version},
        states=[RolloutState(version=version, state="promoted", previous_stable=over), *others],
    )


def batch(start: int, version: int, n: int = 8) -> list:
    """``n`` samples served by ``version``: half accepted, half rejected (both carry gradient)."""
    out = []
    for i in range(start, start + n):
        completion = [966, 446, 12258, 24, 104, 25, 198 if i % 2 else 29856]
        reward = 0.75 if i % 2 else -0.25
        out.append(make_sample(i, PROMPT, completion, [-10.8] * len(completion), reward, version=version))
    return out


class Gate:
    """The gate's evaluator: records every request it gets (the attack is a gate run during the hold)."""

    def __init__(self) -> None:
        self.requests: list[EvalRequest] = []

    def __call__(self, req: EvalRequest):
        self.requests.append(req)
        return plain_code(req)


def gate_failed(*versions: int) -> list[RolloutState]:
    return [RolloutState(version=v, state="gate_failed", stable_version=5) for v in versions]


def weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.engine.trainable_state_dict().items()}


def saved(trainer: Trainer, version: int) -> dict[str, torch.Tensor]:
    return load_file(str(trainer.store.path(version) / ADAPTER))


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """The trainer's adapter (its own names) against a published one (peft's file names), tensor by tensor."""
    a = {k.replace(".default.", "."): v for k, v in a.items()}
    b = {k.replace(".default.", "."): v for k, v in b.items()}
    assert a.keys() == b.keys()
    return all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("strategy", ["canary", "bluegreen"])
def test_a_rollback_holds_the_gate_until_resume(strategy, valkey, redis_client, capsys) -> None:
    """Under both controlled strategies: after `onlinerl policy rollback 5` no tick gates, canaries or switches to a
    newer loaded version, and `onlinerl status` names the hold, who set it and when; resume releases it. v9, trained
    on v8's weights, is never gated; v10, trained after the rebase, is gated once the human resumes."""
    keys = Keys(JOB)
    store = RolloutStore(redis_client, keys)
    for v in range(1, 9):
        serve(redis_client, v, 0.0)
    promoted(store, 8, 5, *gate_failed(6, 7))
    gate = Gate()
    ctl = RolloutController(
        redis_client, JOB, RolloutConfig(strategy=strategy, gate={"enabled": True}), gate, gate_retry_seconds=0
    )
    assert main(["policy", "--redis-url", valkey.url, "--job", JOB, "rollback", "5"]) == 0
    capsys.readouterr()
    table = store.policy()
    serve(redis_client, 9, 0.0)  # published on v8's lineage before the trainer saw the rollback
    serve(redis_client, 10, table.rollback_at)  # trained from v5's weights after it
    decided = ctl.tick()
    assert [(d.decision, d.version) for d in decided] == [("supersede", 9)]
    assert "trained on weights the manual rollback to v5 at " in decided[0].reason
    for _ in range(5):
        assert ctl.tick() == []
    assert gate.requests == [], "a gate ran while a human's rollback held the table"
    table = store.policy()
    assert (table.stable, table.candidate, table.hold, table.rollback_to) == (5, None, 5, 5)
    assert store.state(10) is None, "v10 was judged (gated or superseded) during the hold"
    who = f"cli:{getpass.getuser()}"
    assert table.hold_by == who and table.hold_at > 0
    activity, _ = store.activity()
    assert activity == f"held at v5 by {who}: v10 waits for `onlinerl policy resume` to be gated"
    text = render(collect(redis_client, JOB))
    assert f"held: stable v5 held by {who} at " in text
    assert "no version is gated, canaried or made stable until `onlinerl policy resume`" in text

    assert main(["policy", "--redis-url", valkey.url, "--job", JOB, "resume"]) == 0
    assert store.policy().hold is None and store.policy().hold_by == ""
    assert "held:" not in render(collect(redis_client, JOB))
    if strategy == "canary":
        [rec] = ctl.tick()
        assert (rec.decision, rec.version, rec.stable) == ("gate_pass", 10, 5)
        assert [(r.candidate, r.stable) for r in gate.requests] == [(10, 5)]
    else:  # blue/green gates only once stable has its baseline: the hold no longer stops it, the baseline does
        assert ctl.tick() == []
        assert gate.requests == [] and "v10 waits for stable v5's baseline" in store.activity()[0]
    assert store.state(9).state == "superseded"


def test_rollback_v8_to_v5_under_canary_no_gate_until_resume_and_the_trainer_rebases_onto_v5(
    tmp_path, valkey, redis_client, tiny_model_path
) -> None:
    keys = Keys(JOB)
    store = RolloutStore(redis_client, keys)
    cfg = trainer_config(tmp_path / "ckpt", valkey.url, tiny_model_path)
    trainer = Trainer(cfg, redis_client, tiny_model_path)
    trainer.start()
    # v1..v8, one update each; serving loads each; v8 ends up stable, promoted over v5
    train_and_serve(trainer, redis_client, range(1, 9))
    promoted(store, 8, 5, *gate_failed(6, 7))
    # an update on v8's weights is trained but not yet published when the human acts
    a_ids = xadd_samples(redis_client, batch(100, 8))
    assert trainer.train_on(trainer.collect()) is not None and trainer.pending_ack == a_ids
    assert not same(weights(trainer), saved(trainer, 8))
    assert not same(saved(trainer, 8), saved(trainer, 5))

    assert main(["policy", "--redis-url", valkey.url, "--job", JOB, "rollback", "5"]) == 0
    table = store.policy()
    assert (table.stable, table.hold, table.rollback_to) == (5, 5, 5)

    # Before it trains again, the trainer is back on v5's weights (the loop calls this first in every update).
    assert trainer.follow_rollback(table)
    assert trainer.version == 5 and same(weights(trainer), saved(trainer, 5))
    assert trainer.pending_ack == [], "the update trained on v8's weights was dropped with them"
    b_ids = xadd_samples(redis_client, batch(200, 5))
    assert trainer.train_on(trainer.collect()) is not None  # A, queued again, comes first
    assert trainer.train_on(trainer.collect()) is not None
    assert sorted(trainer.pending_ack) == sorted(a_ids + b_ids)
    assert trainer.publish() == 9
    manifest = trainer.store.manifest(9)
    assert (manifest.parent_version, manifest.rebased_from, manifest.rollback_at) == (5, 8, table.rollback_at)
    assert manifest.sample_ids == sorted(a_ids + b_ids, key=lambda s: tuple(map(int, s.split("-"))))
    assert trainer.publisher.kept_sample_ids(9).keys() == {9, 5, 4, 3, 2, 1}, "v6..v8 are off v9's lineage"
    serve(redis_client, 9)

    # The controller, under canary, with v9 loaded: nothing gated while the rollback holds.
    gate = Gate()
    ctl = RolloutController(redis_client, JOB, RolloutConfig(strategy="canary"), gate)
    for _ in range(3):
        assert ctl.tick() == []
    assert gate.requests == [] and store.policy().candidate is None

    # A restarted trainer resumes v9, which already follows this rollback: no second rebase.
    v9 = weights(trainer)
    trainer.close()
    again = Trainer(cfg, redis_client, tiny_model_path)
    try:
        again.start()
        assert again.follow_rollback(store.policy())
        assert again.version == 9 and again.rebased_from is None and same(weights(again), saved(again, 9))
        assert same(weights(again), v9)
        xadd_samples(redis_client, batch(300, 9))
        assert again.train_on(again.collect()) is not None and again.publish() == 10
        m10 = again.store.manifest(10)
        assert (m10.parent_version, m10.rebased_from, m10.rollback_at) == (9, None, table.rollback_at)
    finally:
        again.close()
    serve(redis_client, 10)

    assert main(["policy", "--redis-url", valkey.url, "--job", JOB, "resume"]) == 0
    decided = ctl.tick()
    assert [(d.decision, d.version) for d in decided] == [("supersede", 9), ("gate_pass", 10)]
    assert [(r.candidate, r.stable) for r in gate.requests] == [(10, 5)]


def test_a_rollback_target_the_trainer_cannot_load_stops_training_not_the_rollback(
    tmp_path, valkey, redis_client, tiny_model_path
) -> None:
    """A target whose files no longer match its manifest is refused, loudly: nothing is trained on the rolled-back
    weights meanwhile (the batch stays unacknowledged for later), and the status hash says why."""
    store = RolloutStore(redis_client, Keys(JOB))
    cfg = trainer_config(tmp_path / "ckpt", valkey.url, tiny_model_path)
    trainer = Trainer(cfg, redis_client, tiny_model_path)
    try:
        trainer.start()
        train_and_serve(trainer, redis_client, (1, 2))
        redis_client.hset(Keys(JOB).policy, mapping={"stable": "2"})
        with open(trainer.store.path(1) / ADAPTER, "ab") as f:
            f.write(b"\0")
        assert main(["policy", "--redis-url", valkey.url, "--job", JOB, "rollback", "1"]) == 0
        ids = xadd_samples(redis_client, batch(50, 2))
        before = weights(trainer)
        assert trainer.train_on(trainer.collect()) is None
        assert trainer.version == 2 and trainer.step == 2
        assert same(weights(trainer), before)
        assert [e.sample_id for e in trainer.feed.replay] == ids, "the batch waits, unacknowledged"
        status = redis_client.hget(Keys(JOB).trainer_status, "rebase").decode()
        assert status.startswith("cannot rebase onto v1 (the rollback's target): ") and "not training" in status
        assert store.policy().stable == 1
    finally:
        trainer.close()


def test_a_version_published_between_the_rollback_and_the_rebase_is_never_gated(
    tmp_path, valkey, redis_client, tiny_model_path
) -> None:
    """The race: the trainer publishes v3 (trained on rolled-back v2) just after the human's rollback, before it
    reads the table. v3 is announced off the rollback's lineage, so the controller never gates it, not even after
    resume; the trainer rebases onto v1 and its v4 (parent v1, rebased_from v3) is the one gated."""
    store = RolloutStore(redis_client, Keys(JOB))
    cfg = trainer_config(tmp_path / "ckpt", valkey.url, tiny_model_path)
    trainer = Trainer(cfg, redis_client, tiny_model_path)
    gate = Gate()
    ctl = RolloutController(redis_client, JOB, RolloutConfig(strategy="canary"), gate)
    try:
        trainer.start()
        train_and_serve(trainer, redis_client, (1, 2))
        promoted(store, 2, 1)
        xadd_samples(redis_client, batch(40, 2))
        trainer.train_on(trainer.collect())
        assert main(["policy", "--redis-url", valkey.url, "--job", JOB, "rollback"]) == 0  # to the previous stable
        assert trainer.publish() == 3  # the trainer had not read the table since
        serve(redis_client, 3)
        assert trainer.store.manifest(3).rollback_at is None
        assert main(["policy", "--redis-url", valkey.url, "--job", JOB, "resume"]) == 0
        decided = ctl.tick()
        assert [(d.decision, d.version) for d in decided] == [("supersede", 3)] and gate.requests == []

        xadd_samples(redis_client, batch(60, 3))
        assert trainer.train_on(trainer.collect()) is not None and trainer.publish() == 4
        m4 = trainer.store.manifest(4)
        assert (m4.parent_version, m4.rebased_from, m4.rollback_at) == (1, 3, store.policy().rollback_at)
        serve(redis_client, 4)
        [rec] = ctl.tick()
        assert (rec.decision, rec.version, rec.stable) == ("gate_pass", 4, 1)
        assert [(r.candidate, r.stable) for r in gate.requests] == [(4, 1)]
    finally:
        trainer.close()
