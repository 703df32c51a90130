"""One trainer at a time: the lease, its fencing token, and Redis refusing a stale trainer's announce and acknowledge.

Three tests: the Lua fence itself against hostile callers (lapsed, older, forged tokens, a version that is not newer);
a stale in-process Trainer (its lease lapsed, another took it) whose publish is refused and whose folder goes; and two
real ``python -m onlinerl_trainer`` processes on one stream: one publishes, the other waits, then takes over, and the
announced lineage never forks.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
import redis
import yaml

from onlinerl.keys import SAMPLES_GROUP, Keys
from onlinerl.procs import Child, python_module, wait_for
from onlinerl.valkey import EmbeddedValkey, free_port
from onlinerl_trainer.checkpoint import CheckpointStore
from onlinerl_trainer.fence import FencedOut, Lease
from onlinerl_trainer.metrics import MetricsServer, TrainerMetrics
from onlinerl_trainer.trainer import Trainer

from .conftest import JOB, make_sample, stream_ids, trainer_config, xadd_samples

KEYS = Keys(JOB)
PROMPT = [1604, 803, 24, 81, 28, 278, 727, 472, 1003, 253, 1232, 278, 198]


def samples(n: int, start: int = 0):
    out = []
    for i in range(start, start + n):
        completion = [966, 446, 12258, 24, 104, 25, 198 if i % 2 else 29856]
        out.append(make_sample(i, PROMPT, completion, [-10.8] * len(completion), 0.75 if i % 2 else -0.25))
    return out


def announced(client: redis.Redis) -> list[dict[str, str]]:
    return [{k.decode(): v.decode() for k, v in f.items()} for _, f in client.xrange(KEYS.checkpoints)]


def delivered(client: redis.Redis, n: int) -> list[str]:
    """``n`` samples on the stream, delivered to a trainer and not yet acknowledged: what a fenced ack may drop."""
    client.xgroup_create(KEYS.samples, SAMPLES_GROUP, id="0", mkstream=True)
    ids = xadd_samples(client, samples(n))
    client.xreadgroup(SAMPLES_GROUP, "trainer-0", {KEYS.samples: ">"})
    return ids


def lapse(client: redis.Redis, lease: Lease) -> None:
    """Wait (on the condition, not a sleep) until ``lease``'s key has expired in Redis."""
    wait_for(lambda: client.get(KEYS.trainer_lease) is None, timeout=10, what=f"{lease.holder}'s lease to expire")


def test_the_fence_refuses_lapsed_older_and_forged_tokens(redis_client, valkey):
    """On a valkey of its own: the lease's 300 ms TTL is timed here, and nothing else may touch the lease."""
    r = redis_client
    ids = delivered(r, 3)

    a = Lease(r, KEYS, "pod-a", ttl_ms=300)
    assert a.try_acquire() is None and a.token == 1
    b = Lease(r, KEYS, "pod-b", ttl_ms=10_000)
    assert b.try_acquire() == "1 pod-a"  # held by someone else: b must wait, and is told by whom
    a.announce({"version": "1", "path": "/x/v1"})
    assert [e["fence"] for e in announced(r)] == ["1"]

    lapse(r, a)  # a's pod froze past its TTL; it does not know yet
    assert b.try_acquire() is None and b.token == 2
    with pytest.raises(FencedOut):
        a.announce({"version": "2", "path": "/x/v2"})
    with pytest.raises(FencedOut):
        a.ack(ids)
    assert a.lost.is_set() and not a.renew()  # and its renewal cannot bring the old token back
    assert a.try_acquire() == "2 pod-b"  # nor can it take the lease over from another holder
    assert len(announced(r)) == 1 and stream_ids(r) == set(ids)  # nothing announced, nothing dropped

    forged = Lease(r, KEYS, "pod-b", ttl_ms=10_000)  # same holder name, but guessing tokens is refused
    for token in (0, 1, 3, -1):
        forged.token = token
        with pytest.raises(FencedOut):
            forged.ack(ids[:1])
    assert stream_ids(r) == set(ids)

    with pytest.raises(FencedOut, match="not newer"):  # the holder itself cannot announce backwards or twice
        b.announce({"version": "1", "path": "/x/v1"})
    b.announce({"version": "2", "path": "/x/v2"})
    assert b.ack(ids) == 3 and stream_ids(r) == set()
    assert [(e["version"], e["fence"]) for e in announced(r)] == [("1", "1"), ("2", "2")]

    b.release()
    assert r.get(KEYS.trainer_lease) is None
    c = Lease(r, KEYS, "pod-c")
    assert c.try_acquire() is None and c.token == 3  # tokens are never reused
    c.release()


def test_a_token_that_comes_again_after_the_fence_is_lost_does_not_pass_for_its_new_holder(redis_client):
    """A flush, or a failover to a replica that missed the last INCR, loses ``trainer:fence``: tokens start at 1
    again. A stale trainer still holding the old 1 must not renew, announce, acknowledge or release under the new
    holder's 1 (the lease is matched by token and holder name both)."""
    r = redis_client
    ids = delivered(r, 2)
    stale = Lease(r, KEYS, "old-pod", ttl_ms=60_000)
    assert stale.try_acquire() is None and stale.token == 1
    r.delete(KEYS.trainer_lease, KEYS.trainer_fence)  # the data is lost; the old pod does not know

    new = Lease(r, KEYS, "new-pod", ttl_ms=60_000)
    assert new.try_acquire() is None and new.token == 1  # the same number, another holder
    r.pexpire(KEYS.trainer_lease, 5_000)
    assert not stale.renew() and stale.lost.is_set()  # its renewal is refused ...
    assert 0 < r.pttl(KEYS.trainer_lease) <= 5_000  # ... and did not extend the new holder's lease
    with pytest.raises(FencedOut):
        stale.announce({"version": "1", "path": "/x/v1"})
    with pytest.raises(FencedOut):
        stale.ack(ids)
    stale.release()  # a no-op: the lease is not its own
    assert r.get(KEYS.trainer_lease) == b"1 new-pod"
    assert len(announced(r)) == 0 and stream_ids(r) == set(ids)  # nothing announced, nothing dropped
    new.announce({"version": "1", "path": "/x/v1"})
    assert new.ack(ids) == 2 and [e["fence"] for e in announced(r)] == ["1"]
    new.release()


def test_a_stale_trainer_cannot_publish_and_its_successor_trains_its_samples(
    tmp_path, redis_client, valkey, tiny_model_path
):
    r = redis_client
    cfg = trainer_config(tmp_path / "ckpt", valkey.url, tiny_model_path)
    old_lease = Lease(r, KEYS, "old-pod", ttl_ms=3000)
    assert old_lease.try_acquire() is None  # taken, but never renewed: the old pod freezes in its grace period
    old = Trainer(cfg, r, tiny_model_path, lease=old_lease)
    old.start()
    ids = xadd_samples(r, samples(8))
    assert old.train_on(old.collect()) is not None
    assert old.write_version() == 1  # on disk while it still held the lease ... then it froze
    lapse(r, old_lease)

    new_lease = Lease(r, KEYS, "new-pod")
    assert new_lease.acquire(poll_s=0.05)
    with pytest.raises(FencedOut):
        old.publish()  # its announcement is refused by Redis
    assert r.xlen(KEYS.checkpoints) == 0 and stream_ids(r) == set(ids)  # not announced, not acknowledged
    assert old.store.versions() == []  # the folder it wrote is on no lineage: removed
    xadd_samples(r, samples(1, start=8))
    with pytest.raises(FencedOut):
        old.run(threading.Event())  # its loop stops at once
    with pytest.raises(FencedOut):
        old.write_version()  # and it writes nothing more
    assert old.store.versions() == []
    ids = sorted(stream_ids(r), key=lambda s: tuple(map(int, s.split("-"))))

    new = Trainer(cfg, r, tiny_model_path, lease=new_lease)
    assert new.version == 0
    rec = new.start()
    assert rec.replayed == 8  # the stale trainer's delivered samples are trained again, by the lease holder
    assert new.train_on(new.collect()) is not None and new.train_on(new.collect()) is not None
    assert new.publish() == 1
    store = CheckpointStore(tmp_path / "ckpt" / JOB)
    assert store.manifest(1).sample_ids == ids and store.manifest(1).parent_version == 0
    assert [(e["version"], e["fence"]) for e in announced(r)] == [("1", str(new_lease.token))]
    assert stream_ids(r) == set()
    new.close()
    assert r.get(KEYS.trainer_lease) is None


def test_two_trainer_processes_one_publishes_the_other_waits_then_takes_over(
    tmp_path, redis_client, valkey, tiny_model_path
):
    r = redis_client
    ports = {"pod-a": free_port(), "pod-b": free_port()}
    children: dict[str, Child] = {}

    def start(holder: str) -> Child:
        cfg = trainer_config(
            tmp_path / "ckpt",
            valkey.url,
            tiny_model_path,
            metricsPort=ports[holder],
            checkpoint={"everySteps": 1},
        )
        config_file = tmp_path / f"{holder}.yaml"
        config_file.write_text(yaml.safe_dump(cfg.dump()))
        env = {
            "ONLINERL_CONFIG": str(config_file),
            "OMP_NUM_THREADS": "1",
            "ONLINERL_TRAINER_HOLDER": holder,
            "ONLINERL_TRAINER_LEASE_SECONDS": "3",
        }
        children[holder] = Child(holder, python_module("onlinerl_trainer"), tmp_path / f"{holder}.log", env=env)
        return children[holder].start()

    def holder() -> str:
        raw = r.get(KEYS.trainer_lease)
        return raw.decode().partition(" ")[2] if raw else ""

    def status() -> dict[str, str]:
        return {k.decode(): v.decode() for k, v in r.hgetall(KEYS.trainer_status).items()}

    all_ids = xadd_samples(r, samples(16))
    try:
        start("pod-a")
        wait_for(lambda: r.xlen(KEYS.checkpoints) >= 1, timeout=120, what="pod-a to publish")
        assert holder() == "pod-a"
        start("pod-b")
        wait_for(
            lambda: "pod-b" in status().get("waiting_for_lease", ""), timeout=60, what="pod-b to wait for the lease"
        )
        wait_for(lambda: r.xlen(KEYS.samples) == 0, timeout=120, what="pod-a to train the first samples")
        all_ids += xadd_samples(r, samples(8, start=16))
        wait_for(lambda: r.xlen(KEYS.samples) == 0, timeout=120, what="pod-a to train more while pod-b waits")
        assert holder() == "pod-a" and children["pod-b"].proc.poll() is None  # pod-b still waits, publishing nothing
        a_versions = len(announced(r))

        t0 = time.monotonic()
        assert children["pod-a"].stop() == 0  # SIGTERM: publish what was trained, give the lease up
        wait_for(lambda: holder() == "pod-b", timeout=30, what="pod-b to take the lease over")
        takeover_s = time.monotonic() - t0
        all_ids += xadd_samples(r, samples(16, start=24))
        wait_for(lambda: r.xlen(KEYS.samples) == 0, timeout=120, what="pod-b to train after the takeover")
        wait_for(lambda: status().get("state") == "waiting", timeout=60, what="pod-b to finish publishing")
        children["pod-b"].signal(signal.SIGTERM)
        assert children["pod-b"].proc.wait(60) == 0
    finally:
        for child in children.values():
            child.kill()

    store = CheckpointStore(tmp_path / "ckpt" / JOB)
    entries = announced(r)
    versions = [int(e["version"]) for e in entries]
    assert versions == list(range(1, len(versions) + 1)) == store.versions()  # strictly increasing, no gaps
    assert len(versions) > a_versions  # pod-b published after the takeover
    assert [store.manifest(v).parent_version for v in versions] == [0, *versions[:-1]]  # one lineage, no fork
    fences = [int(e["fence"]) for e in entries]
    assert fences == sorted(fences) and len(set(fences)) == 2  # pod-a's token, then pod-b's larger one
    trained = [sid for v in versions for sid in store.manifest(v).sample_ids]
    assert sorted(trained) == sorted(all_ids)  # each sample in exactly one version
    assert r.xpending(KEYS.samples, SAMPLES_GROUP)["pending"] == 0
    b_log = Path(tmp_path / "pod-b.log").read_text()
    assert "waiting for the trainer lease: held by 'pod-a'" in b_log
    assert takeover_s < 10, f"pod-b took {takeover_s:.1f}s to take over a released lease"
    print(f"takeover after release: {takeover_s:.2f}s; versions {versions}; fences {sorted(set(fences))}")


def test_a_folder_off_the_resumed_lineage_does_not_count_as_trained(tmp_path, redis_client, valkey, tiny_model_path):
    """A stale trainer that crashed after its rename but before its refused announcement leaves a v{N} on no lineage:
    its sample ids must not be acknowledged as trained by the next trainer (they are not in the weights it resumes)."""
    r = redis_client
    cfg = trainer_config(tmp_path / "ckpt", valkey.url, tiny_model_path)
    first = Trainer(cfg, r, tiny_model_path)
    first.start()
    a_ids = xadd_samples(r, samples(8))
    first.train_on(first.collect())
    assert first.publish() == 1
    c_ids = xadd_samples(r, samples(8, start=8))
    assert len(first.collect()) == 8  # delivered to trainer-0, never trained: pending
    first.close()

    store = CheckpointStore(tmp_path / "ckpt" / JOB)
    v1 = store.manifest(1)

    def forge(version: int, parent: int, ids: list[str]) -> None:
        """A valid folder (files and sha256s of v1) that says it is ``version`` with these sample ids."""
        shutil.copytree(store.path(1), store.path(version))
        manifest = v1.model_copy(update={"version": version, "parent_version": parent, "sample_ids": ids})
        (store.path(version) / "manifest.json").write_bytes(manifest.to_json())

    forge(2, 1, c_ids)  # the stale trainer's residue: claims the pending samples, on no lineage
    forge(3, 1, [])  # the lease holder's version, built on v1 while the residue appeared
    second = Trainer(cfg, r, tiny_model_path)
    assert second.version == 3 and second.trained_ids == set(a_ids)
    rec = second.start()
    assert (rec.already_trained, rec.replayed) == (0, 8)  # v2's ids are trained again, not acknowledged
    assert stream_ids(r) == set(c_ids)
    assert second.train_on(second.collect())["samples"] == 8.0
    assert second.publish() == 4 and store.manifest(4).sample_ids == c_ids and stream_ids(r) == set()
    second.close()


def test_healthz_fails_when_the_trainer_can_no_longer_renew_its_lease(tmp_path: Path) -> None:
    """A trainer cut off from Redis cannot publish or acknowledge: its /healthz must say so (503 with the reason), so
    the orchestrator restarts it; a standby waiting for the lease is healthy."""
    vk = EmbeddedValkey(tmp_path / "valkey", durable=False).start()
    client = redis.Redis.from_url(vk.url, socket_timeout=0.5, socket_connect_timeout=0.5)
    lease = Lease(client, Keys("health"), "trainer-a", ttl_ms=900)
    server = MetricsServer(TrainerMetrics(), "127.0.0.1", 0, health=lease.health).start()
    url = f"http://127.0.0.1:{server.port}/healthz"
    try:
        waiting = httpx.get(url, timeout=5)
        assert (waiting.status_code, waiting.text) == (200, "waiting for the trainer lease")
        assert lease.acquire()
        held = httpx.get(url, timeout=5)
        assert held.status_code == 200 and held.text == f"training: lease held with fencing token {lease.token}"
        vk.stop()  # Redis gone: renewals fail
        wait_for(lambda: httpx.get(url, timeout=5).status_code == 503, timeout=10, what="/healthz failing")
        assert "could not renew the trainer lease" in httpx.get(url, timeout=5).text or lease.lost.is_set()
        wait_for(lease.lost.is_set, timeout=10, what="the lease given up after its whole TTL")
        lost = httpx.get(url, timeout=5)
        assert lost.status_code == 503 and "the trainer lease is lost" in lost.text
    finally:
        server.stop()
        with contextlib.suppress(redis.ConnectionError):  # Redis is gone by now: release stops the renewer first
            lease.release()
        client.close()
        vk.stop()
