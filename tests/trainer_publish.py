"""Publish weights trained in a test the way the trainer does: its own publisher writes the files (full mode: the
weights, the tied LM head, the base's copy with its head for v0), the manifest last, renames the folder, and announces
it under the trainer lease's fence."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import redis

from onlinerl.config import load_config
from onlinerl.keys import Keys


def publish_as_the_trainer(
    config: Path,
    trainer_url: str,
    model,
    base: Path,
    parent: int = 0,
    before_announce: Callable[[Path], None] | None = None,
) -> int:
    """Write and announce ``model``'s weights as version ``parent + 1`` (onlinerl_trainer.publisher), as the Redis
    user of ``trainer_url``; ``before_announce(folder)`` may change the written folder first. Returns the version."""
    from onlinerl_trainer.fence import Lease
    from onlinerl_trainer.publisher import Publisher
    from onlinerl_trainer.stream import SampleStream

    cfg = load_config(config)
    client = redis.Redis.from_url(trainer_url)
    keys = Keys(cfg.job)
    lease = Lease(client, keys, holder="test-publisher")
    try:
        assert lease.acquire()
        stream = SampleStream(client, keys, lease)  # nothing is acknowledged: no samples were trained
        publisher = Publisher(cfg, client, lease, stream, None, base)  # type: ignore[arg-type]
        weights = {k: p.detach().clone() for k, p in model.named_parameters()}  # as the trainer's engine hands them
        version = publisher.write(
            parent=parent, step=1, ids=[], stats={}, weights=weights, module=model, save_state=lambda _: None, meta={}
        )
        if before_announce is not None:
            before_announce(publisher.store.path(version))
        publisher.announce(version)
        return version
    finally:
        lease.release()
        client.close()
