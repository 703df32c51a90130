"""Two data-parallel ranks (torchrun, the launcher interface the DeepSpeed launcher shares) on CPU with gloo.

Rank 0 alone reads the stream; both ranks compute their shard of the micro-batches; DeepSpeed averages the
gradients. The published weights must equal one process training on the whole batch: sharding is invisible.
"""

from __future__ import annotations

import signal
import sys

import pytest
import torch
import yaml
from safetensors.torch import load_file

from onlinerl.keys import SAMPLES_GROUP, Keys
from onlinerl.procs import Child, wait_for
from onlinerl.valkey import free_port
from onlinerl_trainer.batching import collate
from onlinerl_trainer.engine_torch import TorchEngine
from onlinerl_trainer.learner import pad_id as _pad_id
from onlinerl_trainer.policy import load_policy
from onlinerl_trainer.ranks import Ranks, ranks_from_env, shard_slices
from onlinerl_trainer.stream import DEFAULT_CONSUMER
from onlinerl_trainer.update import ppo_update

from .conftest import JOB, as_the_feed_trains, trainer_config, xadd_samples
from .test_deepspeed import batch_of

KEYS = Keys(JOB)


def test_shards_cover_every_micro_batch_once_and_ranks_run_equal_passes():
    slices = [(0, 2), (2, 4), (4, 6)]
    shards = [shard_slices(slices, Ranks(r, 2)) for r in range(2)]
    assert shards == [[(0, 2), (4, 6)], [(2, 4), None]]  # rank 1 pads with a zero-loss pass
    assert shard_slices(slices, Ranks()) == slices
    assert ranks_from_env({"RANK": "1", "WORLD_SIZE": "4"}) == Ranks(1, 4)
    assert ranks_from_env({}) == Ranks(0, 1) and Ranks().leader and not Ranks(1, 2).leader


@pytest.mark.timeout(600)
def test_two_ranks_publish_what_one_process_would(tmp_path, redis_client, empty_valkey, tiny_model_path):
    cfg = trainer_config(
        tmp_path / "ckpt",
        empty_valkey.url,
        tiny_model_path,
        engine="deepspeed",
        zeroStage=2,
        batchSize=6,
        microBatchSize=2,  # 3 micro-batches over 2 ranks: rank 1 also runs a padding pass
        batchTimeoutSeconds=30,
        metricsPort=free_port(),
        algorithm={"learningRate": 1e-2, "staleness": {"maxVersions": 100}},
    )
    config_file = tmp_path / "job.yaml"
    config_file.write_text(yaml.safe_dump(cfg.dump()))
    rows = batch_of(6, seed=5)
    xadd_samples(redis_client, [r.sample for r in rows])

    # One process, the whole batch, plain torch: the reference the two ranks must reproduce.
    single = TorchEngine(load_policy(tiny_model_path, cfg.trainer), cfg.trainer)
    trained, adv = as_the_feed_trains(rows, cfg.trainer.algorithm)
    batch = collate(trained, cfg.trainer.max_seq_len, _pad_id(tiny_model_path))
    result = ppo_update(single, batch, torch.tensor(adv), cfg.trainer.algorithm, cfg.trainer.micro_batch_size)
    assert result.skipped_reason is None
    expected = {k.replace(".default", ""): v for k, v in single.trainable_state_dict().items()}

    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        "-m",
        "onlinerl_trainer",
    ]
    env = {"ONLINERL_CONFIG": str(config_file), "OMP_NUM_THREADS": "1"}
    launcher = Child("trainer-ranks", argv, tmp_path / "ranks.log", env=env).start()
    try:
        wait_for(lambda: redis_client.xlen(KEYS.checkpoints) >= 1, timeout=480, what="v1 from the two ranks")
        consumers = redis_client.xinfo_consumers(KEYS.samples, SAMPLES_GROUP)
        names = [c["name"].decode() if isinstance(c["name"], bytes) else c["name"] for c in consumers]
        assert names == [DEFAULT_CONSUMER]  # only the leader reads the stream
        v1 = load_file(str(tmp_path / "ckpt" / JOB / "v1" / "adapter_model.safetensors"))
        assert set(v1) == set(expected)
        for name, tensor in expected.items():
            torch.testing.assert_close(v1[name], tensor, rtol=1e-4, atol=1e-5, msg=name)
        moved = max(float(tensor.abs().max()) for name, tensor in expected.items() if "lora_B" in name)
        assert moved > 0  # the step really changed the adapter (lora_B starts at zero)
        wait_for(lambda: redis_client.xlen(KEYS.samples) == 0, timeout=60, what="the batch acknowledged")
        launcher.signal(signal.SIGTERM)
        wait_for(
            lambda: redis_client.hget(KEYS.trainer_status, "state") == b"stopped",
            timeout=120,
            what="the leader to stop (the follower is told to leave)",
        )
        launcher.proc.wait(60)
    finally:
        launcher.kill()
    log = (tmp_path / "ranks.log").read_text()
    assert "rank 1/2 following the leader" in log
