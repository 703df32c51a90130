"""A poisoned checkpoint announcement never becomes a loaded version (issue 17): the real reloader loop reading a real
valkey stream, real folders and symlinks on disk. Anyone who can XADD to ``checkpoints`` can announce anything; only
``{storage.checkpointDir}/{job}/v{N}`` with a manifest of the same job and version and matching files may load.

vLLM is not started here (the reloader's engine address answers nothing): what is under test is everything the
reloader decides before it talks to vLLM. The loads of good versions against real vLLM: test_serving_vllm.py.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from pathlib import Path

import httpx
import orjson
import pytest
import redis
import redis.asyncio as aioredis

from onlinerl.config import from_mapping
from onlinerl.dataplane import audit
from onlinerl.keys import Keys
from onlinerl.procs import wait_for
from onlinerl.schemas import CheckpointManifest
from onlinerl.valkey import free_port
from onlinerl_serving.checkpoints import Announcement, CheckpointError, confine
from onlinerl_serving.reloader import Reloader, ReloaderOptions

JOB = "poison"


def folder(d: Path, job: str = JOB, version: int = 1, data: bytes = b"weights") -> Path:
    """A checkpoint folder as the trainer publishes it (files, then manifest.json)."""
    d.mkdir(parents=True)
    (d / "adapter_model.safetensors").write_bytes(data)
    files = {"adapter_model.safetensors": hashlib.sha256(data).hexdigest()}
    m = CheckpointManifest(job=job, version=version, parent_version=0, kind="lora", base_model="b", files=files)
    (d / "manifest.json").write_bytes(m.to_json())
    return d


def announce(r: redis.Redis, version: object, path: Path | str, manifest_sha256: str | None = None) -> None:
    if manifest_sha256 is None:
        mf = Path(path) / "manifest.json"
        manifest_sha256 = hashlib.sha256(mf.read_bytes()).hexdigest() if mf.is_file() else ""
    r.xadd(
        Keys(JOB).checkpoints,
        {"version": str(version), "path": str(path), "kind": "lora", "manifest_sha256": manifest_sha256},
    )


def refused(rl: Reloader) -> dict[str, float]:
    out = {}
    for metric in rl.metrics.registry.collect():
        if metric.name == "onlinerl_reloader_refused_announcements":
            for s in metric.samples:
                if s.name.endswith("_total"):
                    out[s.labels["reason"]] = s.value
    return out


def test_poisoned_announcements_are_refused_and_good_ones_after_them_are_taken(
    tmp_path, empty_valkey, redis_client
) -> None:
    root = tmp_path / "ckpt"
    jobdir = root / JOB
    outside = tmp_path / "elsewhere"
    folder(jobdir / "v1", version=1)
    # Hostile entries, each with a folder whose own manifest is perfectly consistent.
    announce(redis_client, 2, folder(outside / "v2", version=2))  # another folder of the disk
    announce(redis_client, 2, f"{jobdir}/v1/../../../elsewhere/v2")  # climbs out with ..
    folder(outside / "v3", version=3)
    (jobdir / "v3").symlink_to(outside / "v3")  # the right name, a symlink to elsewhere
    announce(redis_client, 3, jobdir / "v3")
    announce(redis_client, 2, jobdir / "v1")  # v1's folder announced as v2
    announce(redis_client, "two", jobdir / "v1")  # not a version at all
    announce(redis_client, 4, folder(jobdir / "v4", version=5))  # manifest of another version
    announce(redis_client, 5, folder(jobdir / "v5", version=5, data=b"good"))
    (jobdir / "v5" / "adapter_model.safetensors").write_bytes(b"poisoned")  # tampered after its manifest
    v6 = folder(jobdir / "v6", version=6)  # a listed file that is a symlink out of the folder
    (v6 / "adapter_model.safetensors").unlink()
    (outside / "secret").write_bytes(b"weights")
    (v6 / "adapter_model.safetensors").symlink_to(outside / "secret")
    announce(redis_client, 6, v6)
    # ...and the good ones after them.
    announce(redis_client, 1, jobdir / "v1")
    announce(redis_client, 2, folder(jobdir / "v2", version=2))
    announce(redis_client, 2, jobdir / "v2", manifest_sha256="0" * 64)  # a second claim on v2: the first stands

    cfg = from_mapping(
        {
            "job": JOB,
            "storage": {"checkpointDir": str(root)},
            "serving": {"engineUrl": f"http://127.0.0.1:{free_port()}", "maxLoadFailures": 1},
        }
    )

    async def go() -> None:
        r = aioredis.from_url(empty_valkey.url)
        async with httpx.AsyncClient(base_url=cfg.serving.engine_url, timeout=1) as engine:
            rl = Reloader(cfg, r, engine, engine, options=ReloaderOptions(poll_seconds=0.1))
            task = asyncio.create_task(rl.run())
            try:
                await asyncio.to_thread(wait_for, lambda: rl.last_id != "0-0", 10, what="boot read")
                assert sorted(rl.versions) == [1, 2, 4, 5, 6]  # 3 and every misplaced claim never registered
                assert rl.versions[2].ann.path == str(jobdir / "v2")
                assert refused(rl) == {
                    "outside_checkpoint_dir": 1,
                    "path_traversal": 1,
                    "symlink_escape": 1,
                    "wrong_version": 1,
                    "malformed": 1,
                    "conflicting_announcement": 1,
                }
                # The contents are checked before vLLM is asked: these three are refused, 1 and 2 pass.
                for v in (4, 5, 6):
                    assert await rl.load(v) is False and rl.versions[v].state == "failed"
                assert {k: refused(rl).get(k) for k in ("manifest_mismatch", "checksum_mismatch")} == {
                    "manifest_mismatch": 1,
                    "checksum_mismatch": 1,
                }
                assert refused(rl)["symlink_escape"] == 2
                # Every refusal is on the audit stream too, one entry each, with its reason.
                audited = [orjson.loads(d) for _, d in audit.read(redis_client, Keys(JOB))]
                assert sorted(e["reason"] for e in audited if e["outcome"] == "refused_by_reloader") == sorted(
                    reason for reason, n in refused(rl).items() for _ in range(int(n))
                )
                assert "says job=poison v5" in rl.versions[4].error and "sha256 differs" in rl.versions[5].error
                for v in (1, 2):
                    await asyncio.to_thread(rl.validate, v)
                # A poisoned entry arriving while the loop runs: refused, and the loop keeps going.
                announce(redis_client, 7, outside / "v2")
                announce(redis_client, 7, folder(jobdir / "v7", version=7))
                await asyncio.to_thread(wait_for, lambda: 7 in rl.versions, 10, what="v7 registered")
                assert rl.versions[7].ann.path == str(jobdir / "v7") and refused(rl)["outside_checkpoint_dir"] == 2
                assert not task.done()
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                await r.aclose()

    asyncio.run(go())


@pytest.mark.parametrize(
    ("path", "reason"),
    [
        ("{root}/poison/v1", None),
        ("{real}/poison/v1", None),  # the trainer announces resolved paths
        ("{root}/poison/./v1", None),
        ("{root}/poison/v1/", None),
        ("poison/v1", "outside_checkpoint_dir"),  # relative to the reloader's cwd: not our folder
        ("{root}/other-job/v1", "outside_checkpoint_dir"),
        ("{root}/v1", "outside_checkpoint_dir"),
        ("{root}/poison/v1/v1", "outside_checkpoint_dir"),
        ("{root}/poison/v10", "wrong_version"),
        ("{root}/poison/.tmp-v1-7", "wrong_version"),
        ("{root}/poison/x/../v1", "path_traversal"),
        ("{root}/poison/v1\0", "wrong_version"),
        ("/", "outside_checkpoint_dir"),
        ("", "outside_checkpoint_dir"),
    ],
)
def test_confine_accepts_only_the_version_folder(tmp_path: Path, path: str, reason: str | None) -> None:
    real = tmp_path / "real"
    folder(real / JOB / "v1")
    (tmp_path / "mount").symlink_to(real)  # the checkpoint folder itself may be a mount's symlink
    root = tmp_path / "mount"
    ann = Announcement("1-0", 1, path.format(root=root, real=real), "lora", "")
    if reason is None:
        assert confine(ann, root, JOB) == Path(os.path.abspath(ann.path))
    else:
        with pytest.raises(CheckpointError) as err:
            confine(ann, root, JOB)
        assert err.value.reason == reason


def test_refusals_written_from_two_places_at_once_are_audited_exactly_once(
    tmp_path: Path, empty_valkey, redis_client
) -> None:
    """The stream loop and a load both flush the refusals; when they overlap on the same await, each refusal is
    still one audit entry (CI once saw a symlink escape audited twice), and one refused during a write is kept."""
    cfg = from_mapping({"job": JOB, "storage": {"checkpointDir": str(tmp_path)}})

    async def go() -> None:
        r = aioredis.from_url(empty_valkey.url)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{free_port()}", timeout=1) as engine:
            rl = Reloader(cfg, r, engine, engine)
            rl._refuse("v6", CheckpointError("a symlink out of the folder", "symlink_escape"))
            first, second = asyncio.create_task(rl._write_refusals()), asyncio.create_task(rl._write_refusals())
            await asyncio.sleep(0)  # both are now inside the write: the first awaits Redis, the second ran after it
            rl._refuse("v7", CheckpointError("outside", "outside_checkpoint_dir"))  # refused while they write
            await asyncio.gather(first, second)
            await rl._write_refusals()
            await r.aclose()

    asyncio.run(go())
    reasons = [orjson.loads(d)["reason"] for _, d in audit.read(redis_client, Keys(JOB))]
    assert reasons == ["symlink_escape", "outside_checkpoint_dir"]


def test_a_refusal_whose_audit_write_fails_is_written_on_the_next_try(
    tmp_path: Path, empty_valkey, redis_client
) -> None:
    """Redis away during the write: the refusal stands, its audit entry waits in front of later ones."""
    cfg = from_mapping({"job": JOB, "storage": {"checkpointDir": str(tmp_path)}})

    async def go() -> None:
        dead = aioredis.from_url(f"redis://127.0.0.1:{free_port()}")
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{free_port()}", timeout=1) as engine:
            rl = Reloader(cfg, dead, engine, engine)
            rl._refuse("v6", CheckpointError("a symlink out of the folder", "symlink_escape"))
            with pytest.raises(redis.exceptions.ConnectionError):
                await rl._write_refusals()
            rl._refuse("v7", CheckpointError("outside", "outside_checkpoint_dir"))
            rl.redis = aioredis.from_url(empty_valkey.url)
            await rl._write_refusals()
            await rl.redis.aclose()
            await dead.aclose()

    asyncio.run(go())
    reasons = [orjson.loads(d)["reason"] for _, d in audit.read(redis_client, Keys(JOB))]
    assert reasons == ["symlink_escape", "outside_checkpoint_dir"]
