"""Crash safety: nothing acknowledged goes untrained, nothing trained into a published version is trained again.

Two tests: a deterministic in-process crash at the worst moment (version on disk, not announced, samples not
acknowledged), and a real ``kill -9`` of ``python -m onlinerl_trainer`` in the middle of a step.
"""

from __future__ import annotations

import signal
from pathlib import Path

import httpx
import torch
import yaml

from onlinerl.keys import SAMPLES_GROUP, Keys
from onlinerl.procs import Child, python_module, wait_for
from onlinerl.valkey import free_port
from onlinerl_trainer.checkpoint import CheckpointStore
from onlinerl_trainer.trainer import Trainer

from .conftest import JOB, make_sample, stream_ids, trainer_config, xadd_samples

KEYS = Keys(JOB)
PROMPT = [1604, 803, 24, 81, 28, 278, 727, 472, 1003, 253, 1232, 278, 198]


def samples(n: int, start: int = 0, prompt_repeat: int = 1):
    out = []
    for i in range(start, start + n):
        completion = [966, 446, 12258, 24, 104, 25, 198 if i % 2 else 29856]
        out.append(
            make_sample(i, PROMPT * prompt_repeat, completion, [-10.8] * len(completion), 0.75 if i % 2 else -0.25)
        )
    return out


def all_manifest_ids(store: CheckpointStore) -> list[str]:
    return [sid for v in store.versions() for sid in store.manifest(v).sample_ids]


def test_restart_after_publish_before_ack_skips_trained_and_claims_dead_consumers(
    tmp_path, redis_client, valkey, tiny_model_path
):
    cfg = trainer_config(tmp_path / "ckpt", valkey.url, tiny_model_path)
    first = Trainer(cfg, redis_client, tiny_model_path)
    first.start()
    ids = xadd_samples(redis_client, samples(16))
    first.train_on(first.collect())
    assert first.publish() == 1
    first.train_on(first.collect())
    assert first.write_version() == 2  # durable on disk ... and the process dies before announcing / acknowledging
    weights_v2 = first.engine.trainable_state_dict()
    opt_state = {k: v["exp_avg"].clone() for k, v in first.engine.optimizer.state_dict()["state"].items()}
    assert redis_client.xlen(KEYS.samples) == 8 and redis_client.xlen(KEYS.checkpoints) == 1
    # Another consumer (a previous trainer pod) took 4 samples and died too.
    dead_ids = xadd_samples(redis_client, samples(4, start=16))
    redis_client.xreadgroup(SAMPLES_GROUP, "trainer-old-pod", {KEYS.samples: ">"}, count=10)
    del first

    second = Trainer(cfg, redis_client, tiny_model_path, claim_idle_ms=0)
    assert (second.version, second.step) == (2, 2)
    resumed = second.engine.trainable_state_dict()
    assert all(torch.equal(resumed[k], weights_v2[k]) for k in weights_v2)
    resumed_opt = second.engine.optimizer.state_dict()["state"]
    assert all(torch.equal(resumed_opt[k]["exp_avg"], v) for k, v in opt_state.items())

    rec = second.start()
    assert (rec.claimed, rec.already_trained, rec.replayed) == (4, 8, 4)
    assert [int(f[b"version"]) for _, f in redis_client.xrange(KEYS.checkpoints)] == [1, 2]  # v2 re-announced
    assert stream_ids(redis_client) == set(dead_ids)  # v2's samples acknowledged without retraining
    stats = second.train_on(second.collect())
    assert stats is not None and stats["samples"] == 4
    assert second.publish() == 3
    assert second.store.manifest(3).sample_ids == dead_ids
    assert all_manifest_ids(second.store) == ids + dead_ids  # each sample in exactly one version
    assert redis_client.xlen(KEYS.samples) == 0


def test_kill_9_during_a_step_loses_nothing_and_trains_nothing_twice(tmp_path, redis_client, valkey, tiny_model_path):
    port = free_port()
    cfg = trainer_config(
        tmp_path / "ckpt",
        valkey.url,
        tiny_model_path,
        checkpoint={"everySteps": 2, "everySeconds": 1.0},
        metricsPort=port,
        maxSeqLen=256,
        algorithm={"staleness": {"maxVersions": 100}},
    )  # all samples come from v0
    config_file = tmp_path / "job.yaml"
    config_file.write_text(yaml.safe_dump(cfg.dump()))
    env = {"ONLINERL_CONFIG": str(config_file), "OMP_NUM_THREADS": "1"}
    all_ids = xadd_samples(redis_client, samples(64, prompt_repeat=12))  # 8 steps of 8 x ~160 tokens
    store = CheckpointStore(tmp_path / "ckpt" / JOB)

    def status() -> dict[str, str]:
        return {k.decode(): v.decode() for k, v in redis_client.hgetall(KEYS.trainer_status).items()}

    trainer = Child("trainer", python_module("onlinerl_trainer"), tmp_path / "trainer1.log", env=env).start()
    try:
        # Kill in the middle of the 4th step: v1 is out, step 3 is trained but not in any version yet.
        wait_for(
            lambda: status().get("state") == "training" and int(status().get("step", 0)) >= 3,
            timeout=120,
            interval=0.005,
            what="the trainer to be inside its 4th step",
        )
        trainer.signal(signal.SIGKILL)
        trainer.proc.wait(10)
    finally:
        trainer.kill()
    killed_in = status()
    # Killed inside the 4th step, or (on a loaded box, where the poll above can lag the trainer by a step) while it
    # published v2: either way it was mid-work, and the checks below hold the same promise.
    assert killed_in["state"] in ("training", "publishing"), killed_in
    acked = set(all_ids) - stream_ids(redis_client)
    trained = all_manifest_ids(store)
    assert acked <= set(trained), "a sample was acknowledged without being in a published version"
    assert len(trained) < len(all_ids)

    trainer = Child("trainer", python_module("onlinerl_trainer"), tmp_path / "trainer2.log", env=env).start()
    try:
        trainer.wait_healthy(f"http://127.0.0.1:{port}/healthz", timeout=120)
        wait_for(lambda: redis_client.xlen(KEYS.samples) == 0, timeout=120, what="all samples trained and acked")
        # Redis restarts under the running trainer (AOF keeps the stream): it reconnects and goes on.
        valkey.restart()
        all_ids += xadd_samples(redis_client, samples(16, start=64, prompt_repeat=12))
        wait_for(lambda: redis_client.xlen(KEYS.samples) == 0, timeout=120, what="samples after the Redis restart")
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        assert trainer.stop() == 0  # SIGTERM: graceful
    finally:
        trainer.kill()
    trained = all_manifest_ids(store)
    assert sorted(trained) == sorted(all_ids), "every sample in exactly one published version"
    assert redis_client.xpending(KEYS.samples, SAMPLES_GROUP)["pending"] == 0
    versions = store.versions()
    assert versions == list(range(1, len(versions) + 1))
    assert all(store.verify(v) for v in versions)
    assert [int(f[b"version"]) for _, f in redis_client.xrange(KEYS.checkpoints)] == versions
    for name in (
        "onlinerl_trainer_loss",
        "onlinerl_trainer_clip_fraction",
        "onlinerl_trainer_approx_kl",
        "onlinerl_trainer_ratio_mean",
        "onlinerl_trainer_ratio_max",
        "onlinerl_trainer_reward_mean",
        "onlinerl_trainer_advantage_mean",
        "onlinerl_trainer_advantage_std",
        "onlinerl_trainer_entropy",
        "onlinerl_trainer_grad_norm",
        "onlinerl_trainer_samples_total",
        "onlinerl_trainer_tokens_total",
        "onlinerl_trainer_steps_total",
        "onlinerl_trainer_skipped_steps_total",
        "onlinerl_trainer_stale_samples_total",
        "onlinerl_trainer_step_duration_seconds_bucket",
        "onlinerl_trainer_sample_staleness_versions_bucket",
        "onlinerl_trainer_policy_version",
        "onlinerl_trainer_last_checkpoint_timestamp_seconds",
    ):
        assert f"\n{name}" in metrics, name
    assert "recovery: claimed 0, acknowledged" in Path(tmp_path / "trainer2.log").read_text()
