"""A stop asked for while a batch is being collected starts no update (issue 40's sibling: a SIGTERM is answered in
the time of a publish, not of a step); the collected samples stay pending and the next trainer trains each of them
exactly once. Through the real trainer loop and a real valkey."""

from __future__ import annotations

import threading

from onlinerl.keys import SAMPLES_GROUP, Keys
from onlinerl.procs import wait_for
from onlinerl_trainer.trainer import Trainer

from .conftest import JOB, make_sample, trainer_config, xadd_samples

PROMPT = [1604, 803, 24, 81, 28, 278, 727, 472, 1003, 253, 1232, 278, 198]


def samples(n: int):
    return [make_sample(i, PROMPT, [100 + i, 200 + i, 300 + i], [-2.0, -2.0, -2.0], 0.75) for i in range(n)]


def test_a_stop_while_collecting_trains_nothing_more_and_the_next_trainer_trains_the_batch_once(
    tmp_path, redis_client, empty_valkey, tiny_model_path
):
    # A batch that would wait 60 s to fill: the stop comes while it is still being collected.
    cfg = trainer_config(tmp_path / "ckpt", empty_valkey.url, tiny_model_path, batchSize=64, batchTimeoutSeconds=60)
    first = Trainer(cfg, redis_client, tiny_model_path)
    first.start()
    ids = xadd_samples(redis_client, samples(4))
    stop = threading.Event()
    loop = threading.Thread(target=first.run, args=(stop,), daemon=True)
    loop.start()
    pending = lambda: redis_client.xpending(Keys(JOB).samples, SAMPLES_GROUP)["pending"]  # noqa: E731
    wait_for(lambda: pending() == 4, 30, what="the trainer to read the 4 samples")
    stop.set()
    loop.join(30)
    assert not loop.is_alive()
    assert first.store.latest() == 0, "no version: nothing was trained"
    assert pending() == 4, "the collected samples stay pending for the next start"
    assert redis_client.hget(Keys(JOB).trainer_status, "state") == b"stopped"
    first.close()

    cfg = trainer_config(tmp_path / "ckpt", empty_valkey.url, tiny_model_path, batchSize=4, batchTimeoutSeconds=0.5)
    second = Trainer(cfg, redis_client, tiny_model_path)
    second.start()
    stop = threading.Event()
    loop = threading.Thread(target=second.run, args=(stop,), daemon=True)
    loop.start()
    try:
        wait_for(lambda: second.store.latest() >= 1 and pending() == 0, 60, what="the batch trained and acknowledged")
    finally:
        stop.set()
        loop.join(60)
    assert sorted(second.store.manifest(1).sample_ids) == sorted(ids)  # each sample in exactly one version
    assert second.store.latest() == 1
    second.close()
