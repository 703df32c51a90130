"""The rendered multi-node launch works: two processes started with the operator's own torchrun arguments (nnodes 2,
node rank 0 and 1, static rendezvous; gloo on CPU, the tiny model) rendezvous, rank 1 never reads the samples stream,
and the v1 they publish equals what one process trains on the same batch.

Only what cannot exist on one machine is replaced: pod 0's DNS name by 127.0.0.1 (and a free port), and the kubelet's
expansion of ``$(NODE_RANK)`` (the completion index) by the value itself.
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
from onlinerl_operator.render import RenderContext
from onlinerl_operator.render_trainer import NODE_RANK_ENV, torchrun_command, world_size
from onlinerl_trainer.batching import collate
from onlinerl_trainer.engine_torch import TorchEngine
from onlinerl_trainer.learner import pad_id
from onlinerl_trainer.policy import load_policy
from onlinerl_trainer.stream import DEFAULT_CONSUMER
from onlinerl_trainer.update import ppo_update
from tests.trainer.conftest import JOB, as_the_feed_trains, trainer_config, xadd_samples
from tests.trainer.test_deepspeed import batch_of

KEYS = Keys(JOB)


def local_argv(command: list[str], node_rank: int, port: int) -> list[str]:
    """The pod's command on this machine: torchrun as a module of this interpreter, pod 0 at 127.0.0.1:port."""
    argv = [sys.executable, "-m", "torch.distributed.run", *command[1:]]
    argv[argv.index("--master-addr") + 1] = "127.0.0.1"
    argv[argv.index("--master-port") + 1] = str(port)
    return [str(node_rank) if a == f"$({NODE_RANK_ENV})" else a for a in argv]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_nodes_with_the_rendered_launch_publish_what_one_process_would(
    tmp_path, redis_client, valkey, tiny_model_path
) -> None:
    cfg = trainer_config(
        tmp_path / "ckpt",
        valkey.url,
        tiny_model_path,
        engine="deepspeed",
        zeroStage=2,
        nodes=2,
        batchSize=4,
        microBatchSize=2,
        batchTimeoutSeconds=30,
        metricsPort=free_port(),
        algorithm={"learningRate": 1e-2, "staleness": {"maxVersions": 100}},
    )
    ctx = RenderContext(name=JOB, namespace="team-a", uid="u-1", cfg=cfg)
    command = torchrun_command(ctx)
    assert world_size(ctx) == 2 and command[command.index("--nnodes") + 1] == "2"
    config_file = tmp_path / "job.yaml"
    config_file.write_text(yaml.safe_dump(cfg.dump()))
    rows = batch_of(4, seed=7)
    xadd_samples(redis_client, [r.sample for r in rows])

    # One process, the whole batch, plain torch: the reference.
    single = TorchEngine(load_policy(tiny_model_path, cfg.trainer), cfg.trainer)
    alg = cfg.trainer.algorithm
    trained, adv = as_the_feed_trains(rows, alg)
    batch = collate(trained, cfg.trainer.max_seq_len, pad_id(tiny_model_path))
    assert ppo_update(single, batch, torch.tensor(adv), alg, cfg.trainer.micro_batch_size).skipped_reason is None
    expected = {k.replace(".default", ""): v for k, v in single.trainable_state_dict().items()}

    port = free_port()
    env = {"ONLINERL_CONFIG": str(config_file), "OMP_NUM_THREADS": "1"}
    nodes = [
        Child(f"node-{i}", local_argv(command, i, port), tmp_path / f"node{i}.log", env={**env, NODE_RANK_ENV: str(i)})
        for i in (0, 1)
    ]
    for node in nodes:
        node.start()
    try:
        wait_for(lambda: redis_client.xlen(KEYS.checkpoints) >= 1, timeout=480, what="v1 from the two nodes")
        consumers = redis_client.xinfo_consumers(KEYS.samples, SAMPLES_GROUP)
        names = [c["name"].decode() if isinstance(c["name"], bytes) else c["name"] for c in consumers]
        assert names == [DEFAULT_CONSUMER]  # only global rank 0 (node 0) reads the stream
        v1 = load_file(str(tmp_path / "ckpt" / JOB / "v1" / "adapter_model.safetensors"))
        assert set(v1) == set(expected)
        for name, tensor in expected.items():
            torch.testing.assert_close(v1[name], tensor, rtol=1e-4, atol=1e-5, msg=name)
        wait_for(lambda: redis_client.xlen(KEYS.samples) == 0, timeout=60, what="the batch acknowledged")
        nodes[0].signal(signal.SIGTERM)
        wait_for(
            lambda: redis_client.hget(KEYS.trainer_status, "state") == b"stopped",
            timeout=120,
            what="the leader to stop (node 1 is told to leave)",
        )
        for node in nodes:
            node.proc.wait(60)
    finally:
        for node in nodes:
            node.kill()
    follower = (tmp_path / "node1.log").read_text()
    assert "rank 1/2 following the leader" in follower
