"""`onlinerl forget --tenant T --user KEY` after simulated traffic (issue 38).

Traffic: rollouts recorded by the gateway's own record path (``RolloutStore``), rated through the real feedback
service (accepts, and a resent completion id: samples, audit entries, contribution counters, user statistics),
then trained by the real trainer (tiny model, in process): v1 on Alice's and Bob's samples, v2 on Bob's only (v1's
child), and more samples of both left pending; each component as its own ACL user, as `onlinerl up` runs them
(none refused anything). Then the command, in process, as the admin Redis user:
no record, sample, audit entry or per-user counter of Alice is left anywhere in Redis, Bob's and the other tenant's
data are untouched to the entry, and the report counts what it deleted and names v1 (trained on Alice) and v2 (its
descendant).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from onlinerl.auth import user_hash
from onlinerl.cli import main as cli
from onlinerl.config import from_mapping
from onlinerl.dataplane import acl
from onlinerl.dataplane import samples as sample_family
from onlinerl.keys import Keys
from onlinerl.redisconn import connect_async
from onlinerl.schemas import RolloutRecord, SamplingParams
from onlinerl.valkey import EmbeddedValkey, RedisUsers
from onlinerl_serving.capture import RolloutStore
from onlinerl_trainer.trainer import Trainer
from tests.privacy_corpus import every_value

from .conftest import JOB, FeedbackServer, start_feedback

ALICE, BOB, GLOBEX = "key-acme-alice", "key-acme-bob", "key-globex-1"
TENANTS = {"acme": [ALICE, BOB], "globex": [GLOBEX]}
K = Keys(JOB)
PROMPT_IDS = [1604, 803, 24, 81, 28, 278, 727, 472, 1003, 253, 1232, 278, 198]
COMPLETION_IDS = [966, 446, 12258, 24, 104, 25, 198]


@pytest.fixture
def vk(tmp_path: Path) -> Iterator[EmbeddedValkey]:
    """A valkey locked down as `onlinerl up` runs it: each component as its own ACL user, `forget` as admin."""
    server = EmbeddedValkey(tmp_path / "valkey", users=RedisUsers(JOB, acl.new_passwords()))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def feedback(tmp_path: Path, vk: EmbeddedValkey) -> Iterator[FeedbackServer]:
    server = start_feedback(tmp_path / "feedback", vk.url_for("feedback"), tenants=TENANTS)
    try:
        yield server
    finally:
        server.stop()


def record(tenant: str, key: str, n: int) -> RolloutRecord:
    return RolloutRecord(
        rollout_id=f"{key}-{n}",
        tenant=tenant,
        policy_version=0,
        served_model="onlinerl-base",
        user_hash=user_hash(key),
        prompt=f"# {key} file {n}\ndef f_{n}(",
        prompt_token_ids=PROMPT_IDS,
        completion=f"x{n}): return {n}",
        completion_token_ids=COMPLETION_IDS,
        behaviour_logprobs=[-1.5] * len(COMPLETION_IDS),
        sampling=SamplingParams(temperature=0.7, top_p=1.0, max_tokens=16),
    )


async def traffic(url: str, feedback_url: str, users: list[tuple[str, str]], start: int, count: int) -> None:
    """Each user is served ``count`` rollouts (the gateway's record write) and accepts them (feedback), and resends
    its first upload (a duplicate: an audit entry)."""
    client = connect_async(from_mapping({}).redis, url)
    store = RolloutStore(client, K, 1800)
    try:
        async with httpx.AsyncClient(timeout=30) as http:
            for tenant, key in users:
                for n in range(start, start + count):
                    rec = record(tenant, key, n)
                    await store.store(rec)
                    body = {
                        "completionId": f"{key}-c{n}",
                        "accepted": True,
                        "completion": rec.completion,
                        "prompt": rec.prompt,
                    }
                    for _ in range(2 if n == start else 1):
                        r = await http.post(
                            f"{feedback_url}/api/training/submit",
                            json=body,
                            headers={"Authorization": f"Bearer {key}"},
                        )
                        assert r.status_code == 200, r.text
    finally:
        await store.close()
        await client.aclose()


def train_version(trainer: Trainer) -> int:
    assert trainer.train_on(trainer.collect()) is not None
    version = trainer.publish()
    assert version is not None
    return version


def holdings(client: redis.Redis, key: str) -> dict[str, int]:
    """How many records, samples, audit entries and counter keys of one user are anywhere in Redis."""
    uh = user_hash(key).encode()
    out = {"records": 0, "samples": 0, "audit": 0}
    for k in client.scan_iter(match=f"{K.prefix}rollouts:*"):
        out["records"] += sum(1 for v in client.hvals(k) if uh in v)
    out["samples"] = sum(1 for _, f in client.xrange(K.samples) if uh in f[b"data"])
    out["audit"] = sum(1 for _, f in client.xrange(K.audit) if uh in f[b"data"])
    # the lineage (the checkpoints stream: which versions were trained on whose samples) keeps the user hash by design,
    # for as long as the version exists: it is what `forget` reports; everything else counts
    lineage = sum(1 for _, f in client.xrange(K.checkpoints) if uh in f.get(b"contributors", b""))
    out["anywhere_but_lineage"] = sum(1 for v in every_value(client) if uh in v) - lineage
    return out


@pytest.mark.slow
def test_forget_a_user_deletes_all_of_theirs_and_names_the_versions_they_trained(
    tmp_path: Path, vk: EmbeddedValkey, feedback: FeedbackServer, tiny_model_path: Path
) -> None:
    redis_client = redis.Redis.from_url(vk.url)  # admin: what the test reads with, and what forget runs as
    gateway_url = vk.url_for("gateway")
    acme = [("acme", ALICE), ("acme", BOB)]
    asyncio.run(traffic(gateway_url, feedback.url, acme, 0, 4))
    cfg = from_mapping(
        {
            "job": JOB,
            "model": {"path": str(tiny_model_path), "maxModelLen": 256},
            "redis": {"url": vk.url_for("trainer")},
            "storage": {"checkpointDir": str(tmp_path / "ckpt")},
            "trainer": {
                "engine": "torch",
                "batchSize": 8,
                "microBatchSize": 8,
                "batchTimeoutSeconds": 0.5,
                "maxSeqLen": 256,
                "lora": {"r": 8, "alpha": 16},
                "checkpoint": {"everySteps": 1},
                "algorithm": {"learningRate": 1e-3},
            },
        }
    )
    trainer = Trainer(cfg, redis.Redis.from_url(vk.url_for("trainer")), tiny_model_path)
    trainer.start()
    assert train_version(trainer) == 1  # Alice's and Bob's 8 samples
    assert trainer.store.manifest(1).contributors == {"acme": sorted([user_hash(ALICE), user_hash(BOB)])}
    asyncio.run(traffic(gateway_url, feedback.url, [("acme", BOB)], 4, 4))
    assert train_version(trainer) == 2  # Bob's only, trained from v1
    assert trainer.store.manifest(2).contributors == {"acme": [user_hash(BOB)]}
    trainer.close()
    # more traffic left pending (no trainer runs), and another tenant's
    asyncio.run(traffic(gateway_url, feedback.url, [*acme, ("globex", GLOBEX)], 10, 2))

    alice, bob, globex = (holdings(redis_client, k) for k in (ALICE, BOB, GLOBEX))
    assert alice["records"] == 6 and alice["samples"] == 2 and alice["audit"] == 2
    assert bob["records"] == 10 and bob["samples"] == 2 and globex["samples"] == 2
    bob_samples = [i for i, d in sample_family.read_all(redis_client, K) if user_hash(BOB).encode() in d]
    bob_contrib = sorted(k for k in redis_client.scan_iter(match=f"{K.prefix}contrib:acme:*"))
    assert len(bob_contrib) == 2  # Alice's and Bob's hourly counters (both sent this hour)

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli(["forget", "--tenant", "acme", "--user", ALICE, "--redis-url", vk.url, "--job", JOB])
    assert code == 0
    text = out.getvalue()
    assert ALICE not in text  # the key is never printed
    report = json.loads(text[: text.rindex("}") + 1])
    assert report["user_hash"] == user_hash(ALICE)
    assert report["deleted"]["rollout_records"] == 6
    assert report["deleted"]["samples"] == 2
    assert report["deleted"]["audit_entries"] == 2
    assert report["deleted"]["user_counters"] >= 2  # its hourly contribution counter and its user statistics
    assert report["deleted"]["index_entries"] == 6
    assert (report["trained_versions"], report["descendant_versions"]) == ([1], [2])
    assert "v1, v2" in text

    left = holdings(redis_client, ALICE)
    assert left == {"records": 0, "samples": 0, "audit": 0, "anywhere_but_lineage": 0}, left
    assert holdings(redis_client, BOB) == bob and holdings(redis_client, GLOBEX) == globex  # the others untouched
    assert [i for i, d in sample_family.read_all(redis_client, K) if user_hash(BOB).encode() in d] == bob_samples
    assert redis_client.exists(K.user_stats("acme", "")) == 1  # the tenant's totals stay for a user forget

    # a tenant-wide forget leaves nothing of acme, and globex as it was
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli(["forget", "--tenant", "acme", "--redis-url", vk.url, "--job", JOB]) == 0
    assert holdings(redis_client, BOB)["anywhere_but_lineage"] == 0
    assert not list(redis_client.scan_iter(match=f"{K.prefix}*:acme:*")) and not redis_client.exists(
        K.user_stats("acme", "")
    )
    assert holdings(redis_client, GLOBEX) == globex
    assert redis_client.acl_log() == []  # gateway, feedback and trainer did all this as their own users
    redis_client.close()


def test_forget_refuses_a_tenant_name_that_could_address_other_keys(empty_valkey: EmbeddedValkey) -> None:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = cli(["forget", "--tenant", "acme:*", "--redis-url", empty_valkey.url, "--job", JOB])
    assert code != 0 and "--tenant" in err.getvalue()
