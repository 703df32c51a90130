"""Helpers for the trainer tests: a job config on a real valkey and a temp checkpoint dir, and sample records.

The feedback service is not needed: the tests XADD TrainingSample records themselves, exactly as the contract says
feedback does (field ``data`` on the job's samples stream).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis

from onlinerl.config import AlgorithmConfig, OnlineRLConfig, from_mapping
from onlinerl.keys import Keys
from onlinerl.schemas import TrainingSample
from onlinerl_trainer.advantages import RunningBaseline, select_trainable
from onlinerl_trainer.batching import StreamSample

JOB = "tjob"


def trainer_config(checkpoint_dir: Path, redis_url: str, model_path: Path, **trainer: Any) -> OnlineRLConfig:
    base: dict[str, Any] = {
        "engine": "torch",
        "batchSize": 8,
        "microBatchSize": 8,
        "batchTimeoutSeconds": 0.5,
        "maxSeqLen": 256,  # >= model.maxModelLen (validated); rows are padded to the batch's longest, not to this
        "lora": {"r": 8, "alpha": 16},
        "checkpoint": {"everySteps": 1, "keep": 100},
        "algorithm": {"learningRate": 1e-3},
    }
    for key, value in trainer.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = {**base[key], **value}
        else:
            base[key] = value
    return from_mapping(
        {
            "job": JOB,
            "model": {"path": str(model_path), "maxModelLen": 256},
            "redis": {"url": redis_url},
            "storage": {"checkpointDir": str(checkpoint_dir)},
            "trainer": base,
        }
    )


def make_sample(
    i: int,
    prompt: Sequence[int],
    completion: Sequence[int],
    logprobs: Sequence[float],
    reward: float,
    version: int = 0,
    tenant: str = "acme",
) -> TrainingSample:
    return TrainingSample(
        event_id=f"ev-{i}",
        rollout_id=f"ro-{i}",
        tenant=tenant,
        policy_version=version,
        prompt_token_ids=list(prompt),
        completion_token_ids=list(completion),
        behaviour_logprobs=list(logprobs),
        reward=reward,
        accepted=reward > 0,
    )


def xadd_samples(client: redis.Redis, samples: Sequence[TrainingSample]) -> list[str]:
    key = Keys(JOB).samples
    return [client.xadd(key, {"data": s.to_json()}).decode() for s in samples]


def stream_ids(client: redis.Redis) -> set[str]:
    return {entry_id.decode() for entry_id, _ in client.xrange(Keys(JOB).samples)}


def as_the_feed_trains(rows: list[StreamSample], algo: AlgorithmConfig) -> tuple[list[StreamSample], list[float]]:
    """The rows and advantages a fresh trainer trains from one admitted batch: the feed's own rule
    (advantages.select_trainable) against a new running baseline. A single-process reference built from this sees
    what the trainer's ranks see."""
    chosen = select_trainable(
        [r.sample_id for r in rows],
        [r.sample.reward for r in rows],
        [r.sample.tenant for r in rows],
        algo,
        RunningBaseline(algo.baseline_momentum),
    )
    return [rows[i] for i in chosen.train], chosen.advantages
