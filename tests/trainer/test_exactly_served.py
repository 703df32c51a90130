"""The trainer trains exactly what was served, once, from a verified checkpoint (issue 15).

Real empty_valkey, the tiny model, the real Trainer. A Redis failover is simulated on the real stream: DUMP the samples
key while its entries are delivered but unacknowledged (what a lagging replica holds), RESTORE it after the publish
acknowledged them, and XGROUP SETID the group back to 0 (the lost last-delivered id).
"""

from __future__ import annotations

import logging
import math
import threading

import orjson
import pytest
import torch

from onlinerl.config import ConfigError, from_mapping
from onlinerl.dataplane import audit
from onlinerl.keys import SAMPLES_GROUP, Keys
from onlinerl.procs import wait_for
from onlinerl_trainer.batching import Batch
from onlinerl_trainer.trainer import Trainer
from onlinerl_trainer.validation import sample_problem

from .conftest import JOB, make_sample, stream_ids, trainer_config, xadd_samples

KEYS = Keys(JOB)
PROMPT = [1604, 803, 24, 81, 28, 278, 727]
COMPLETION = [966, 446, 198]
VOCAB = 49152  # the tiny model's embedding rows (SmolLM2's tokenizer)


def sample(i: int, reward: float = 0.75, prompt=PROMPT, completion=COMPLETION, logprobs=None):
    return make_sample(i, prompt, completion, logprobs or [-1.5] * len(completion), reward)


def mixed(n: int, start: int = 0):
    """Rewards that differ, so no advantage is exactly 0 (an inert sample would skip the pass)."""
    return [sample(start + i, reward=0.75 if i % 2 == 0 else -0.25) for i in range(n)]


def metric(trainer: Trainer, line: str) -> float:
    for row in trainer.metrics.render().decode().splitlines():
        if row.startswith(line + " "):
            return float(row.split()[-1])
    raise AssertionError(f"{line} not in metrics")


def manifest_ids(trainer: Trainer) -> list[str]:
    return [sid for v in trainer.store.versions() for sid in trainer.store.manifest(v).sample_ids]


class SeeingTrainer(Trainer):
    """The real trainer; it also keeps the unpadded input rows each PPO update received (a spy, not a mock)."""

    def _update(self, batch: Batch, advantages: torch.Tensor):
        self.seen = getattr(self, "seen", [])
        for ids, mask in zip(batch.input_ids, batch.attention_mask, strict=True):
            self.seen.append(ids[mask.bool()].tolist())
        return super()._update(batch, advantages)


def test_redelivered_trained_ids_are_acknowledged_without_training(
    tmp_path, redis_client, empty_valkey, tiny_model_path
):
    cfg = trainer_config(tmp_path / "ckpt", empty_valkey.url, tiny_model_path)
    trainer = Trainer(cfg, redis_client, tiny_model_path)
    trainer.start()
    first = xadd_samples(redis_client, mixed(4))
    entries = trainer.collect()
    lagging_replica = redis_client.dump(KEYS.samples)  # entries delivered to trainer-0, not acknowledged yet
    assert trainer.train_on(entries)["samples"] == 4
    assert trainer.publish() == 1 and stream_ids(redis_client) == set()

    # Failover to the lagging replica: our XACK + XDELs are lost, and so is the group's last-delivered id.
    redis_client.restore(KEYS.samples, 0, lagging_replica, replace=True)
    redis_client.xgroup_setid(KEYS.samples, SAMPLES_GROUP, "0")
    assert stream_ids(redis_client) == set(first)
    fresh = xadd_samples(redis_client, mixed(2, start=10))
    entries = trainer.collect()
    assert sorted(e.sample_id for e in entries) == sorted(first + fresh)  # all delivered again, to a live trainer
    stats = trainer.train_on(entries)
    assert stats is not None and stats["samples"] == 2  # only the new ones went through the model
    assert metric(trainer, 'onlinerl_trainer_dropped_samples_total{reason="already_trained"}') == 4
    assert stream_ids(redis_client) == set(fresh)  # the re-delivered ones are acknowledged at once
    assert trainer.publish() == 2 and trainer.store.manifest(2).sample_ids == fresh

    # Delivered again while trained but not yet published: skipped, and acknowledged only with its version.
    late = xadd_samples(redis_client, mixed(2, start=20))
    assert trainer.train_on(trainer.collect())["samples"] == 2
    redis_client.xgroup_setid(KEYS.samples, SAMPLES_GROUP, "0")
    again = trainer.collect()
    assert sorted(e.sample_id for e in again) == sorted(late)
    assert trainer.train_on(again) is None
    assert stream_ids(redis_client) == set(late)  # still waiting for the checkpoint that holds them
    assert trainer.publish() == 3 and trainer.store.manifest(3).sample_ids == late

    assert metric(trainer, 'onlinerl_trainer_dropped_samples_total{reason="already_trained"}') == 6
    assert manifest_ids(trainer) == first + fresh + late  # each sample in exactly one version
    assert trainer.samples_trained == 8 and metric(trainer, "onlinerl_trainer_samples_total") == 8
    assert stream_ids(redis_client) == set() and redis_client.xpending(KEYS.samples, SAMPLES_GROUP)["pending"] == 0


def test_tampered_latest_checkpoint_is_refused_and_the_previous_one_resumed(
    tmp_path, redis_client, empty_valkey, tiny_model_path, caplog
):
    cfg = trainer_config(tmp_path / "ckpt", empty_valkey.url, tiny_model_path)
    first = Trainer(cfg, redis_client, tiny_model_path)
    first.start()
    v1_ids = xadd_samples(redis_client, mixed(4))
    first.train_on(first.collect())
    assert first.publish() == 1
    v1_weights = {k: v.clone() for k, v in first.engine.trainable_state_dict().items()}
    v2_ids = xadd_samples(redis_client, mixed(4, start=10))
    first.train_on(first.collect())
    assert first.write_version() == 2  # on disk; the process dies before announcing and acknowledging
    v2_weights = {k: v.clone() for k, v in first.engine.trainable_state_dict().items()}
    del first

    adapter = tmp_path / "ckpt" / JOB / "v2" / "adapter_model.safetensors"
    data = bytearray(adapter.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit in the weights
    adapter.write_bytes(bytes(data))

    with caplog.at_level(logging.ERROR, logger="onlinerl.trainer"):
        second = Trainer(cfg, redis_client, tiny_model_path)
    assert [r.message for r in caplog.records if "refusing corrupt checkpoint v2" in r.message]
    assert second.version == 1 and second.corrupt_versions == [2]
    resumed = second.engine.trainable_state_dict()
    assert all(torch.equal(resumed[k], v1_weights[k]) for k in v1_weights)
    assert any(not torch.equal(resumed[k], v2_weights[k]) for k in v2_weights)  # v2 was not loaded
    assert metric(second, "onlinerl_trainer_corrupt_checkpoints_total") == 1

    rec = second.start()
    assert redis_client.hget(KEYS.trainer_status, "corrupt_versions") == b"2"
    assert redis_client.hget(KEYS.trainer_status, "version") == b"1"
    # v2's samples are not in the weights resumed from: they are trained again, into a new number.
    assert (rec.already_trained, rec.replayed) == (0, 4)
    assert second.train_on(second.collect())["samples"] == 4
    assert second.publish() == 3
    manifest = second.store.manifest(3)
    assert manifest.sample_ids == v2_ids and manifest.parent_version == 1 and second.store.verify(3)
    assert second.store.manifest(1).sample_ids == v1_ids and not second.store.verify(2)
    assert [int(f[b"version"]) for _, f in redis_client.xrange(KEYS.checkpoints)] == [1, 3]
    assert stream_ids(redis_client) == set()


def test_a_sample_is_trained_whole_or_dropped_never_cut(tmp_path, redis_client, empty_valkey, tiny_model_path):
    cfg = trainer_config(tmp_path / "ckpt", empty_valkey.url, tiny_model_path, algorithm={"baseline": "none"})
    assert cfg.trainer.max_seq_len == 256
    trainer = SeeingTrainer(cfg, redis_client, tiny_model_path)
    trainer.start()
    at_limit = [1 + (i * 37) % 40000 for i in range(253)]  # a long, distinctive context: 253 + 3 = 256 tokens
    over = [*at_limit, 42]  # 257 tokens
    fits, too_long = xadd_samples(redis_client, [sample(1, prompt=at_limit), sample(2, prompt=over)])
    stats = trainer.train_on(trainer.collect())
    assert stats is not None and stats["samples"] == 1
    assert trainer.seen == [at_limit + COMPLETION]  # the learner saw the whole served context, nothing cut
    assert metric(trainer, 'onlinerl_trainer_dropped_samples_total{reason="too_long"}') == 1
    assert stream_ids(redis_client) == {fits}  # the dropped one is acknowledged at once, never trained
    assert trainer.publish() == 1 and trainer.store.manifest(1).sample_ids == [fits]
    assert too_long not in manifest_ids(trainer)


def test_config_where_served_samples_would_not_fit_names_both_fields():
    with pytest.raises(ConfigError) as err:
        from_mapping({"model": {"maxModelLen": 4096}, "trainer": {"maxSeqLen": 2048}})
    message = str(err.value)
    assert "trainer.maxSeqLen (2048)" in message and "model.maxModelLen (4096)" in message
    assert "{" not in message  # the whole config is not dumped into the message
    assert from_mapping({}).trainer.max_seq_len == from_mapping({}).model.max_model_len == 2048
    assert from_mapping({"model": {"maxModelLen": 4096}, "trainer": {"maxSeqLen": 4096}}).trainer.max_seq_len == 4096


def test_sample_checks_name_the_problem():
    ok = sample(1)
    assert sample_problem(ok, VOCAB, 256) is None
    cases = {
        "out_of_vocab": ok.model_copy(update={"completion_token_ids": [966, VOCAB, 198]}),
        "length_mismatch": ok.model_copy(update={"behaviour_logprobs": [-1.0]}),
        "bad_logprob": ok.model_copy(update={"behaviour_logprobs": [-1.0, math.nan, -1.0]}),
        "bad_reward": ok.model_copy(update={"reward": math.inf}),
        "empty": ok.model_copy(update={"prompt_token_ids": []}),
        "too_long": ok.model_copy(update={"prompt_token_ids": PROMPT * 40}),
    }
    for reason, bad in cases.items():
        problem = sample_problem(bad, VOCAB, 256)
        assert problem is not None and problem.reason == reason, (reason, problem)
    assert sample_problem(ok.model_copy(update={"prompt_token_ids": [-1, 5]}), VOCAB, 256).reason == "out_of_vocab"
    assert sample_problem(ok.model_copy(update={"behaviour_logprobs": [0.0, 0.0, 0.0]}), VOCAB, 256) is None


def test_hostile_samples_are_acknowledged_counted_and_the_trainer_keeps_running(
    tmp_path, redis_client, empty_valkey, tiny_model_path
):
    cfg = trainer_config(tmp_path / "ckpt", empty_valkey.url, tiny_model_path, batchTimeoutSeconds=0.2)
    trainer = Trainer(cfg, redis_client, tiny_model_path)
    trainer.start()
    stop = threading.Event()
    loop = threading.Thread(target=trainer.run, args=(stop,), daemon=True)
    loop.start()
    try:
        hostile = xadd_samples(
            redis_client,
            [
                sample(1, completion=[966, VOCAB + 7, 198]),  # out of the vocabulary
                sample(2, prompt=[-3, 5, 6]),  # negative id
                sample(3, logprobs=[-1.0]),  # 1 log-prob for 3 tokens
                sample(4, logprobs=[-1.0, 0.5, -1.0]),  # a positive log-prob
            ],
        )
        nan_reward = sample(5).to_json().replace(b'"reward":0.75', b'"reward":NaN')
        assert b"NaN" in nan_reward
        hostile.append(redis_client.xadd(KEYS.samples, {"data": nan_reward}).decode())
        good = xadd_samples(redis_client, mixed(2, start=10))
        wait_for(lambda: trainer.store.latest() >= 1, timeout=120, what="the valid samples published")
        wait_for(lambda: not stream_ids(redis_client), timeout=30, what="every entry acknowledged")
        assert loop.is_alive()
        more = xadd_samples(redis_client, mixed(2, start=20))  # and it goes on training
        wait_for(lambda: trainer.store.latest() >= 2, timeout=120, what="the next samples published")
    finally:
        stop.set()
        loop.join(60)
    assert not loop.is_alive()
    counts = {
        reason: metric(trainer, f'onlinerl_trainer_invalid_samples_total{{reason="{reason}"}}')
        for reason in ("out_of_vocab", "length_mismatch", "bad_logprob", "undecodable")
    }
    assert counts == {"out_of_vocab": 2, "length_mismatch": 1, "bad_logprob": 1, "undecodable": 1}  # NaN: not JSON
    # Each refused entry is accounted for one by one in the audit stream, not only by a counter.
    refusals = {
        entry["stream_id"]: entry["reason"]
        for entry in (orjson.loads(data) for _, data in audit.read(redis_client, KEYS))
        if entry["outcome"] == "refused_by_trainer"
    }
    assert refusals == dict(
        zip(hostile, ["out_of_vocab", "out_of_vocab", "length_mismatch", "bad_logprob", "undecodable"], strict=True)
    )
    assert sorted(manifest_ids(trainer)) == sorted(good + more)
    assert not set(hostile) & set(manifest_ids(trainer))
    assert redis_client.hget(KEYS.trainer_status, "state") == b"stopped"
    assert redis_client.xpending(KEYS.samples, SAMPLES_GROUP)["pending"] == 0
