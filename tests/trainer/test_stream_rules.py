"""Batching by time, invalid entries, the staleness rule (drop / truncated IS weight) and checkpoint retention."""

from __future__ import annotations

import time

import orjson
import pytest

from onlinerl.dataplane import audit, versions
from onlinerl.keys import Keys
from onlinerl.schemas import PolicyVersionState
from onlinerl_trainer.advantages import select_trainable
from onlinerl_trainer.trainer import Trainer

from .conftest import JOB, make_sample, stream_ids, trainer_config, xadd_samples

KEYS = Keys(JOB)
PROMPT = [1604, 803, 24, 81, 28, 278, 727]


def sample(i: int, version: int = 0, reward: float = 0.75):
    completion = [966, 446, 198]
    return make_sample(i, PROMPT, completion, [-10.8] * 3, reward, version)


def train_and_publish(trainer: Trainer, version: int, n: int = 2) -> int:
    xadd_samples(trainer.client, [sample(100 * version + i, trainer.version, 0.75 - i) for i in range(n)])
    assert trainer.train_on(trainer.collect()) is not None
    return trainer.publish()


def counter(trainer: Trainer, line: str) -> float:
    for row in trainer.metrics.render().decode().splitlines():
        if row.startswith(line + " "):
            return float(row.split()[-1])
    raise AssertionError(f"{line} not in metrics")


def test_time_batches_invalid_entries_staleness_and_retention(tmp_path, redis_client, empty_valkey, tiny_model_path):
    cfg = trainer_config(
        tmp_path / "ckpt",
        empty_valkey.url,
        tiny_model_path,
        batchTimeoutSeconds=0.3,
        checkpoint={"keep": 2},
        algorithm={"staleness": {"maxVersions": 1, "mode": "drop"}},
    )
    trainer = Trainer(cfg, redis_client, tiny_model_path)
    trainer.start()

    # A partial batch closes batchTimeoutSeconds after its first entry.
    xadd_samples(redis_client, [sample(i, reward=-0.25 if i == 1 else 0.75) for i in range(3)])  # mixed: A != 0
    t0 = time.monotonic()
    entries = trainer.collect()
    waited = time.monotonic() - t0
    assert len(entries) == 3 and 0.25 <= waited < 3.0
    trainer.train_on(entries)
    assert trainer.publish() == 1

    # Retention keeps the newest 2 plus whatever a replica has loaded or routing points at.
    versions.report(redis_client, KEYS, "r-0", [PolicyVersionState(version=1, state="loaded")], ttl=3600)
    for v in (2, 3, 4):
        assert train_and_publish(trainer, v) == v
    assert trainer.store.versions() == [1, 3, 4]
    versions.report(redis_client, KEYS, "r-0", [PolicyVersionState(version=1, state="retired")], ttl=3600)
    redis_client.hset(KEYS.policy, mapping={"stable": "3"})
    assert train_and_publish(trainer, 5) == 5
    assert trainer.store.versions() == [3, 4, 5]  # v1 retired -> pruned; v3 is stable -> kept

    # Invalid entries are acknowledged (never retried forever) and counted; nothing is trained on them.
    bad_len = sample(900).model_copy(update={"behaviour_logprobs": [-1.0]})
    redis_client.xadd(KEYS.samples, {"data": b"{not json"})
    xadd_samples(redis_client, [bad_len])
    assert trainer.train_on(trainer.collect()) is None
    assert counter(trainer, 'onlinerl_trainer_invalid_samples_total{reason="undecodable"}') == 1
    assert counter(trainer, 'onlinerl_trainer_invalid_samples_total{reason="length_mismatch"}') == 1
    assert stream_ids(redis_client) == set()

    # Staleness at v5 with maxVersions 1, serving caught up (stable v5): v3 samples are dropped (acked at once),
    # v4 samples are trained.
    redis_client.hset(KEYS.policy, mapping={"stable": "5"})
    stale = xadd_samples(redis_client, [sample(950, version=3), sample(951, version=3)])
    fresh = xadd_samples(redis_client, [sample(952, version=4), sample(953, version=4, reward=-0.25)])
    stats = trainer.train_on(trainer.collect())
    assert stats is not None and stats["samples"] == 2
    assert counter(trainer, 'onlinerl_trainer_stale_samples_total{action="dropped"}') == 2
    stale_audit = [orjson.loads(d) for _, d in audit.read(redis_client, Keys(JOB))]
    stale_audit = {e["stream_id"]: e["reason"] for e in stale_audit if e["reason"].startswith("stale")}
    reason = "stale: behaviour v3, 2 versions behind (trainer v5, oldest served v5)"
    assert stale_audit == {sid: reason for sid in stale}  # each drop is on the record
    assert stream_ids(redis_client) == set(fresh)  # trained, waiting for their checkpoint
    assert not set(stale) & set(trainer.pending_ack)
    assert trainer.publish() == 6 and trainer.store.manifest(6).sample_ids == fresh

    # The trainer and the candidates outrun the rollout (a canary serves stable v3 with candidate v6, the trainer's
    # own version, 3 ahead with maxVersions 1): what users are served is never stale, so a v3 sample is trained; a
    # v1 one is two versions behind the oldest served version and dropped.
    redis_client.hset(KEYS.policy, mapping={"stable": "3", "candidate": "6", "canary_share": "0.25"})
    served = xadd_samples(redis_client, [sample(970, version=3), sample(971, version=3, reward=-0.25)])
    gone = xadd_samples(redis_client, [sample(972, version=1)])
    stats = trainer.train_on(trainer.collect())
    assert stats is not None and stats["samples"] == 2
    assert counter(trainer, 'onlinerl_trainer_stale_samples_total{action="dropped"}') == 3
    assert stream_ids(redis_client) == set(served) and not set(gone) & set(trainer.pending_ack)
    assert trainer.publish() == 7 and trainer.store.manifest(7).sample_ids == served
    redis_client.hset(KEYS.policy, mapping={"stable": "7", "candidate": "", "canary_share": "0"})

    # In truncate mode they are trained instead, with the importance weight capped.
    trainer.algo.staleness.mode = "truncate"
    trainer.algo.staleness.truncate_weight = 0.5
    xadd_samples(redis_client, [sample(960, version=2), sample(961, version=2, reward=-0.25)])
    stats = trainer.train_on(trainer.collect())
    assert stats is not None and stats["samples"] == 2
    assert counter(trainer, 'onlinerl_trainer_stale_samples_total{action="downweighted"}') == 2
    assert 0 < stats["is_weight_mean"] <= 0.5
    admitted = 3 + 4 * 2 + 4 + 3 + 2  # every valid sample is observed, dropped or not
    assert counter(trainer, "onlinerl_trainer_sample_staleness_versions_count") == admitted


def test_zero_advantage_samples_are_acknowledged_without_a_pass(tmp_path, redis_client, empty_valkey, tiny_model_path):
    """1/0 rewards, no baseline, no KL: a reject has no gradient, so it costs no forward pass (and is not lost)."""
    cfg = trainer_config(
        tmp_path / "ckpt", empty_valkey.url, tiny_model_path, algorithm={"baseline": "none", "klCoef": 0.0}
    )
    trainer = Trainer(cfg, redis_client, tiny_model_path)
    trainer.start()
    ids = xadd_samples(redis_client, [sample(i, reward=1.0 if i == 0 else 0.0) for i in range(4)])
    stats = trainer.train_on(trainer.collect())
    assert stats is not None and stats["samples"] == 1.0  # only the accept went through the model
    assert counter(trainer, "onlinerl_trainer_inert_samples_total") == 3.0
    assert stream_ids(redis_client) == {ids[0]}  # the rejects are acknowledged; the accept waits for its checkpoint
    assert trainer.publish() == 1 and stream_ids(redis_client) == set()
    assert trainer.store.manifest(1).sample_count == 1

    # All rejects: nothing to train, nothing left pending.
    xadd_samples(redis_client, [sample(10 + i, reward=0.0) for i in range(3)])
    assert trainer.train_on(trainer.collect()) is None
    assert stream_ids(redis_client) == set() and counter(trainer, "onlinerl_trainer_inert_samples_total") == 6.0

    # With a KL term every sample has a gradient again: nothing is skipped (advantages.select_trainable).
    cfg_kl = trainer_config(
        tmp_path / "ckpt2", empty_valkey.url, tiny_model_path, algorithm={"baseline": "none", "klCoef": 0.1}
    )
    chosen = select_trainable(["1-0", "2-0"], [1.0, 0.0], ["acme", "acme"], cfg_kl.trainer.algorithm, None)
    assert (chosen.train, chosen.advantages, chosen.inert) == ([0, 1], [1.0, 0.0], [])


@pytest.mark.parametrize(("weight", "kept_reject"), [(1.0, -0.5), (0.5, -0.25)])
def test_negative_samples_are_subsampled_with_their_weight_and_nothing_is_left_pending(
    tmp_path, redis_client, empty_valkey, tiny_model_path, weight, kept_reject
):
    """negativeSampleRate 0.5 through a real stream: every accept is trained, about half the rejects are trained at
    negativeWeight / 0.5 of their advantage (weight 1: twice it, the same expected gradient; weight 0.5 = the rate,
    the cpu profile's choice: their own advantage), the rest are acknowledged untrained and counted."""
    algo = {"baseline": "none", "negativeSampleRate": 0.5, "negativeWeight": weight}
    cfg = trainer_config(tmp_path / "ckpt", empty_valkey.url, tiny_model_path, algorithm=algo, batchSize=16)
    trainer = Trainer(cfg, redis_client, tiny_model_path)
    trainer.start()
    assert trainer.feed.entries_per_batch() == 32  # about 16 trainable ones when nearly every event is a reject
    rows = [sample(i, reward=0.75 if i < 2 else -0.25) for i in range(16)]
    # Fixed stream ids: which reject is kept is a hash of its id (advantages.keep_fraction, whose rate over 20,000 ids
    # test_advantages checks), so auto ids made this a coin toss: the old bound, 2-12 of 14 kept, failed about once in
    # 270 runs. These 16 ids keep 7 of the 14 rejects.
    for i, row in enumerate(rows):
        redis_client.xadd(Keys(JOB).samples, {"data": row.to_json()}, id=f"1700000000000-{i}")
    admitted = trainer.feed.admit(trainer.collect(), trainer.version)
    kept_rejects = [a for a in admitted.advantages if a < 0]
    assert sorted(a for a in admitted.advantages if a > 0) == [0.75, 0.75]  # every accept
    assert len(kept_rejects) == 7 and set(kept_rejects) == {kept_reject}  # -0.25 * weight / 0.5
    skipped = counter(trainer, "onlinerl_trainer_subsampled_samples_total")
    assert skipped == 14 - len(kept_rejects)
    # what was kept is pending until its version; what was skipped is acknowledged now: nothing lost, nothing twice
    assert stream_ids(redis_client) == {s.sample_id for s in admitted.samples}
