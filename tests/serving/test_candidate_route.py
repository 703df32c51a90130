"""The attack: a replica that has not loaded the candidate (it failed there, or a restarted replica is still loading
it) served the candidate arm "the newest loaded version at or below the candidate" -- a version the rollout judged
and refused (``gate_failed``, ``superseded``, ``rolled_back``), which the reloader keeps loaded among the recent ones.
The candidate arm serves exactly the candidate the gate passed, or stable; never another version.

Without an engine: the gateway's routing function, and the real reloader's load order on a real checkpoints stream.
Through the real gateway and reloader on vLLM: tests/serving/test_candidate_arm.py.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import redis
import redis.asyncio as aioredis

from onlinerl.config import from_mapping
from onlinerl.schemas import PolicyTable
from onlinerl_serving.reloader import Reloader
from onlinerl_serving.routing import choose, route, user_hash
from tests.serving.lora_helpers import announce

JOB = "candarm"


def test_the_candidate_arm_never_falls_back_to_a_judged_version() -> None:
    """Candidate v9 not loaded here, v8 (gate failed) loaded: the candidate arm gets stable v5, not v8."""
    table = PolicyTable(stable=5, candidate=9, canary_share=1.0)
    u = user_hash("sk-a")
    assert choose(table, u) == ("candidate", 9)
    r = route(table, u, {0, 5, 6, 7, 8})
    assert (r.arm, r.version, r.routed_version) == ("candidate", 5, 9)
    assert route(table, u, {0, 5, 8, 9}).version == 9, "the candidate itself once it is loaded here"
    # stable not loaded yet either (a restarted replica): stable's own fallback, never above stable
    assert route(table, u, {0, 7, 8}).version == 0
    assert route(table, u, {0, 4, 8}).version == 4
    assert route(PolicyTable(stable=5), u, {0, 3, 8}).version == 3


def test_a_restarted_reloader_loads_what_users_are_routed_to_first(tmp_path: Path, valkey) -> None:
    """v5 stable, v9 candidate, v6-v8 recent (judged): a new reloader life loads v5 and v9 before v7 and v8, so a
    restarted replica serves the routed versions as early as it can."""
    r = redis.Redis.from_url(valkey.url)
    for v in range(1, 10):  # announced folders (the load order reads no adapter file)
        path = tmp_path / "ckpt" / JOB / f"v{v}"
        path.mkdir(parents=True)
        announce_folder(r, v, path)
    r.close()
    table = PolicyTable(stable=5, candidate=9, canary_share=0.5)
    cfg = from_mapping(
        {"job": JOB, "storage": {"checkpointDir": str(tmp_path / "ckpt")}, "serving": {"keepVersions": 3}}
    )

    async def order() -> list[int]:
        client = aioredis.from_url(valkey.url)
        async with httpx.AsyncClient() as http:
            try:
                rl = Reloader(cfg, client, http, http, replica="r-order")
                await rl.read_stream(None)
                return rl.wanted(table)
            finally:
                await client.aclose()

    assert asyncio.run(order()) == [5, 9, 7, 8]


def announce_folder(r: redis.Redis, version: int, path: Path) -> None:
    (path / "manifest.json").write_text("{}")
    announce(r, JOB, version, path)
