"""Strategy ``direct``: after a human's rollback and resume, a version trained on the dropped weights (announced before
the trainer rebased) is never made stable -- not by a reload, not by a reloader restart that tries every loaded
version again -- while the trainer's rebased version is. Real valkey, the real reloader's stream reader and its raise
script, the CLI's rollback and resume; no engine (the raise is what every load ends in).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import redis
import redis.asyncio as aioredis

from onlinerl.cli import main
from onlinerl.config import from_mapping
from onlinerl.keys import Keys
from onlinerl.schemas import PolicyTable
from onlinerl_serving.reloader import Reloader
from tests.rollout.sim import publish_loaded

JOB = "lineage"


def announce(r: redis.Redis, tmp: Path, version: int, rollback_at: float) -> None:
    """A ``checkpoints`` entry as the trainer's publisher writes it, lineage marker included."""
    path = tmp / "ckpt" / JOB / f"v{version}"
    path.mkdir(parents=True)
    fields = {"version": str(version), "path": str(path), "kind": "lora", "manifest_sha256": "", "created_at": "1"}
    r.xadd(Keys(JOB).checkpoints, {**fields, "rollback_at": repr(rollback_at)})


def raises(url: str, tmp: Path, versions: list[int]) -> list[tuple[bool, str]]:
    """A new reloader life (a restart): read every announcement, then try each version's raise, as its loads do."""

    async def go() -> list[tuple[bool, str]]:
        client = aioredis.from_url(url)
        cfg = from_mapping(
            {"job": JOB, "storage": {"checkpointDir": str(tmp / "ckpt")}, "rollout": {"strategy": "direct"}}
        )
        out = []
        async with httpx.AsyncClient() as http:
            try:
                rl = Reloader(cfg, client, http, http, replica="r-lineage")
                await rl.read_stream(None)
                for v in versions:
                    out.append((await rl._raise_stable(v), rl.last_raise["result"]))
            finally:
                await client.aclose()
        return out

    return asyncio.run(go())


def test_a_version_trained_on_rolled_back_weights_is_never_made_stable(tmp_path: Path, valkey) -> None:
    r = redis.Redis.from_url(valkey.url)
    cli = ["policy", "--redis-url", valkey.url, "--job", JOB]
    try:
        for v in (1, 2):
            announce(r, tmp_path, v, 0.0)
            publish_loaded(r, JOB, v)
        assert raises(valkey.url, tmp_path, [1, 2]) == [(True, "raised"), (True, "raised")]
        assert main([*cli, "rollback"]) == 0  # v2 -> v1
        rollback_at = PolicyTable.from_redis(r.hgetall(Keys(JOB).policy)).rollback_at
        announce(r, tmp_path, 3, 0.0)  # the trainer published v3 (on v2) before it saw the rollback
        assert main([*cli, "resume"]) == 0
        announce(r, tmp_path, 4, rollback_at)  # the rebased trainer's first version (parent v1)
        got = raises(valkey.url, tmp_path, [2, 3, 4])
        assert got == [
            (False, "rolled back before"),
            (False, "trained on weights a manual rollback dropped"),
            (True, "raised"),
        ]
        assert PolicyTable.from_redis(r.hgetall(Keys(JOB).policy)).stable == 4
    finally:
        r.close()
