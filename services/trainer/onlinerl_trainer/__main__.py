"""``python -m onlinerl_trainer``: the trainer process (config from onlinerl.config.load_config).

Under the DeepSpeed launcher (``trainer.gpus > 1``; or torchrun) rank 0 is the leader that talks to Redis and the
other ranks follow it (see ranks.py).

Environment extras (not part of the job spec, since they identify the process rather than configure the job):
``ONLINERL_TRAINER_CONSUMER`` (stream consumer name, default ``trainer-0``: stable, so a restart finds its own
pending samples), ``ONLINERL_TRAINER_CLAIM_IDLE_SECONDS`` (take over another consumer's samples after this idle),
``ONLINERL_TRAINER_HOLDER`` (the lease holder's name, default the host name: the pod name) and
``ONLINERL_TRAINER_LEASE_SECONDS`` (lease TTL, default 15; renewed every third of it). A trainer that cannot take the
lease waits (status ``waiting_for_lease``); one that loses it exits with status 4 (``fenced_out``), publishing nothing.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from pathlib import Path

import torch

from onlinerl import ports
from onlinerl.config import ConfigError, load_config
from onlinerl.keys import Keys
from onlinerl.model import ModelError, resolve_model_path
from onlinerl.redisconn import connect as redis_connect
from onlinerl_trainer.adapters import lines_problem
from onlinerl_trainer.checkpoint import CheckpointStore
from onlinerl_trainer.engine import choose_engine_name
from onlinerl_trainer.fence import FencedOut, Lease
from onlinerl_trainer.learner import Learner
from onlinerl_trainer.metrics import MetricsServer, TrainerMetrics
from onlinerl_trainer.ranks import Ranks, ranks_from_env
from onlinerl_trainer.stream import DEFAULT_CONSUMER
from onlinerl_trainer.trainer import NonFiniteWeightsError, Trainer, default_holder


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("onlinerl.trainer")
    try:
        cfg = load_config()
        if not cfg.redis.url:
            raise ConfigError(
                "redis.url is empty: the trainer needs the Redis that holds the samples stream "
                "(set ONLINERL__REDIS__URL or redis.url)"
            )
        model_path = resolve_model_path(cfg.model.path)
    except (ConfigError, ModelError) as exc:
        print(f"onlinerl-trainer: error: {exc}", file=sys.stderr)
        return 2
    problem = lines_problem(cfg)  # an adapter per project: plain torch, one process
    if problem is not None:
        print(f"onlinerl-trainer: error: {problem}", file=sys.stderr)
        return 2
    ranks = ranks_from_env()
    if ranks.distributed and choose_engine_name(cfg.trainer) != "deepspeed":
        print(
            f"onlinerl-trainer: error: {ranks.world} processes need trainer.engine: deepspeed "
            "(data parallel runs through DeepSpeed's gradient all-reduce)",
            file=sys.stderr,
        )
        return 2
    if cfg.trainer.torch_threads:
        torch.set_num_threads(cfg.trainer.torch_threads)
    if not ranks.leader:
        return follow(cfg, model_path, ranks)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    metrics = TrainerMetrics()
    # Blocking XREADGROUP waits at most Trainer.collect's poll (0.5 s): the reply deadline stays above it.
    client = redis_connect(cfg.redis, longest_block_seconds=1.0, health_check_interval=30)
    keys = Keys(cfg.job)
    lease = Lease(
        client,
        keys,
        os.environ.get("ONLINERL_TRAINER_HOLDER") or default_holder(),
        ttl_ms=int(float(os.environ.get("ONLINERL_TRAINER_LEASE_SECONDS", "15")) * 1000),
    )
    server = MetricsServer(metrics, ports.listen_host(), cfg.trainer.metrics_port, health=lease.health).start()
    trainer = None
    try:
        # 1. The lease first: nothing is read from disk or the stream until this is the only trainer of the job.
        metrics.lease_held.set(0)
        if not lease.acquire(stop):
            return 0
        # 2. Resume the newest good version, re-announce it if a crash left it unannounced, recover pending entries.
        trainer = Trainer(
            cfg,
            client,
            model_path,
            metrics=metrics,
            consumer=os.environ.get("ONLINERL_TRAINER_CONSUMER", DEFAULT_CONSUMER),
            claim_idle_ms=int(float(os.environ.get("ONLINERL_TRAINER_CLAIM_IDLE_SECONDS", "60")) * 1000),
            ranks=ranks,
            lease=lease,
        )
        log.info(
            "trainer for job %s: engine %s, %s weights, starting at v%d",
            cfg.job,
            trainer.engine.name,
            cfg.trainer.weights,
            trainer.version,
        )
        trainer.start()
        # 3. read batch -> advantages -> update -> maybe publish (announce, then acknowledge) until SIGTERM.
        trainer.run(stop)
    except NonFiniteWeightsError as exc:
        log.error("%s", exc)
        return 3
    except FencedOut as exc:
        log.error("fenced out, exiting without publishing: %s", exc)
        metrics.lease_held.set(0)
        return 4
    finally:
        if trainer is not None:
            trainer.close()  # also gives the lease up: a waiting trainer takes over at once
        else:
            lease.release()
        server.stop()
        client.close()
    return 0


def follow(cfg, model_path, ranks: Ranks) -> int:
    """A follower rank: no Redis, no metrics port, no lease; it computes what the leader broadcasts and stops when
    told. It ignores SIGTERM/SIGINT so the leader can finish its step and publish with every rank's help."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    store = CheckpointStore(Path(cfg.storage.checkpoint_dir) / cfg.job)
    learner = Learner.for_follower(cfg.trainer, model_path, ranks, store)
    logging.getLogger("onlinerl.trainer").info("rank %d/%d following the leader", ranks.rank, ranks.world)
    learner.follow()
    return 0


if __name__ == "__main__":
    sys.exit(main())
