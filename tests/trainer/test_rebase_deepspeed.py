"""The rebase after a manual rollback on the DeepSpeed engine (ZeRO on CPU, gloo): the engine is built again from the
target's weights, with a fresh optimizer, and training goes on from there (the plain torch engine's case is in
tests/rollout/test_rollback_rebases.py). Attack: a rebase that only swapped the module's weights would leave
DeepSpeed's own (partitioned) copy and optimizer state on the rolled-back version.
"""

from __future__ import annotations

import pytest
import torch

from onlinerl.keys import Keys
from onlinerl.rollout import manual
from onlinerl.rollout.store import RolloutStore
from onlinerl_trainer.trainer import Trainer
from tests.rollout.sim import publish_loaded

from .conftest import JOB, trainer_config, xadd_samples
from .test_deepspeed import batch_of


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_trainer_rebases_onto_the_rollback_target(
    tmp_path, redis_client, empty_valkey, tiny_model_path, stage
) -> None:
    cfg = trainer_config(
        tmp_path / "ckpt", empty_valkey.url, tiny_model_path, engine="deepspeed", microBatchSize=4, zeroStage=stage
    )
    store = RolloutStore(redis_client, Keys(JOB))
    trainer = Trainer(cfg, redis_client, tiny_model_path)
    try:
        trainer.start()
        published = {}
        for v in (1, 2):
            xadd_samples(redis_client, [s.sample for s in batch_of(8, seed=v)])
            assert trainer.train_on(trainer.collect()) is not None
            assert trainer.publish() == v
            published[v] = {k: t.clone() for k, t in trainer.engine.trainable_state_dict().items()}
            publish_loaded(redis_client, JOB, v)
        assert not all(torch.equal(published[1][k], published[2][k]) for k in published[1])
        redis_client.hset(Keys(JOB).policy, mapping={"stable": "2"})
        manual.rollback(store, 1, actor="test")

        assert trainer.follow_rollback(store.policy())
        assert trainer.engine.name == "deepspeed" and trainer.version == 1
        now = trainer.engine.trainable_state_dict()
        assert all(torch.equal(now[k], published[1][k]) for k in published[1])
        xadd_samples(redis_client, [s.sample for s in batch_of(8, seed=3)])
        assert trainer.train_on(trainer.collect()) is not None
        assert trainer.publish() == 3
        m3 = trainer.store.manifest(3)
        assert (m3.parent_version, m3.rebased_from) == (1, 2) and trainer.store.verify(3)
    finally:
        trainer.close()
