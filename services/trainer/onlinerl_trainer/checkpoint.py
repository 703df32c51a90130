"""Versioned checkpoints on the shared volume: ``{checkpointDir}/{job}/v{N}/`` (layout in docs/architecture.md).

A version directory appears atomically: files go into ``.tmp-v{N}-<random>/`` (random, not the pid: two pods are both
pid 1), are fsynced, the manifest (with the sha256 of every file) is written last, the directory is renamed to ``v{N}``,
and the parent is fsynced. Only then may anyone announce it. Readers ignore dot-directories, so a crash leaves at worst
an ignorable temp directory.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

from onlinerl.checksums import file_problems, sha256_file
from onlinerl.schemas import CheckpointManifest

MANIFEST = "manifest.json"
STATE_DIR = "trainer-state"
STATE_META = "state.json"
_VERSION_RE = re.compile(r"^v(\d+)$")


def _unique() -> str:
    """A temp-name suffix no other writer (another pod, also pid 1) can pick."""
    return uuid.uuid4().hex


def stream_id_key(sample_id: str) -> tuple[int, int]:
    """Order of Redis stream ids ("ms-seq")."""
    ms, _, seq = sample_id.partition("-")
    return int(ms), int(seq or 0)


def render_manifest(
    *,
    job: str,
    version: int,
    parent_version: int,
    kind: str,
    base_model: str,
    step: int,
    sample_ids: Sequence[str],
    metrics: dict[str, float],
    files: dict[str, str],
    created_at: float | None = None,
    rebased_from: int | None = None,
    rollback_at: float | None = None,
    contributors: dict[str, list[str]] | None = None,
    line: str = "",
) -> CheckpointManifest:
    """Pure: the manifest of one version. ``sample_ids`` are the stream ids trained since the parent version;
    ``rebased_from`` / ``rollback_at``: the lineage after a manual rollback (CheckpointManifest); ``line``: the
    policy line it belongs to ('' shared, else the project)."""
    ordered = sorted(set(sample_ids), key=stream_id_key)
    return CheckpointManifest(
        job=job,
        version=version,
        parent_version=parent_version,
        kind=kind,
        base_model=base_model,
        created_at=created_at if created_at is not None else time.time(),
        step=step,
        sample_ids=ordered,
        sample_id_range=(ordered[0], ordered[-1]) if ordered else None,
        sample_count=len(ordered),
        metrics={k: float(v) for k, v in metrics.items()},
        files=files,
        rebased_from=rebased_from,
        rollback_at=rollback_at,
        contributors=contributors or {},
        line=line,
    )


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


class CheckpointStore:
    """The per-job checkpoint directory: list, read, write and prune versions; keep the resume state."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    # --- reading ------------------------------------------------------------------------------------------------
    def versions(self) -> list[int]:
        """Published versions (a ``v{N}`` directory with a manifest), ascending."""
        out = []
        for p in self.root.iterdir():
            m = _VERSION_RE.match(p.name)
            if m and (p / MANIFEST).is_file():
                out.append(int(m.group(1)))
        return sorted(out)

    def latest(self) -> int:
        versions = self.versions()
        return versions[-1] if versions else 0

    def path(self, version: int) -> Path:
        return self.root / f"v{version}"

    def manifest(self, version: int) -> CheckpointManifest:
        return CheckpointManifest.from_json((self.path(version) / MANIFEST).read_bytes())

    def manifest_sha256(self, version: int) -> str:
        return sha256_file(self.path(version) / MANIFEST)

    def verify(self, version: int) -> bool:
        """True when every file has the sha256 the manifest records."""
        return not self.problems(version)

    def problems(self, version: int) -> list[str]:
        """What is wrong with ``v{version}`` (empty: the manifest parses, lists files, and each file matches its
        sha256). A manifest with no files is refused too: nothing in it could be checked."""
        try:
            manifest = self.manifest(version)
        except Exception as exc:  # unreadable or not a CheckpointManifest: as corrupt as a flipped byte
            return [f"{self.path(version) / MANIFEST} is not a valid manifest: {exc}"]
        if manifest.version != version:
            return [f"{self.path(version) / MANIFEST} says version {manifest.version}"]
        if not manifest.files:
            return [f"{self.path(version) / MANIFEST} lists no files"]
        return file_problems(self.path(version), manifest.files)

    def newest_good(self) -> tuple[int, dict[int, list[str]]]:
        """The newest version whose files match its manifest, and the problems of every newer (refused) one."""
        refused: dict[int, list[str]] = {}
        for version in reversed(self.versions()):
            problems = self.problems(version)
            if not problems:
                return version, refused
            refused[version] = problems
        return 0, refused

    # --- writing ------------------------------------------------------------------------------------------------
    def publish(
        self,
        version: int,
        write_files: Callable[[Path], None],
        manifest_for: Callable[[dict[str, str]], CheckpointManifest],
    ) -> Path:
        """Write a version atomically: ``write_files(tmp)``, fsync, manifest last, rename, fsync the parent."""
        final = self.path(version)
        if final.exists():
            raise FileExistsError(f"{final} already exists: versions are immutable")
        tmp = self.root / f".tmp-v{version}-{_unique()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            write_files(tmp)
            files = {}
            for f in sorted(p for p in tmp.rglob("*") if p.is_file()):
                fsync_path(f)
                files[str(f.relative_to(tmp))] = sha256_file(f)
            manifest = manifest_for(files)
            _write_durably(tmp / MANIFEST, json.dumps(manifest.model_dump(mode="json"), indent=2).encode())
            fsync_path(tmp)
            os.rename(tmp, final)
            fsync_path(self.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final

    def clean_temp(self) -> None:
        """Remove temp directories left by a crashed writer (only ours: the trainer is the single writer)."""
        for p in self.root.iterdir():
            if p.is_dir() and (p.name.startswith(".tmp-") or p.name.startswith(".del-")):
                shutil.rmtree(p, ignore_errors=True)

    def prune(self, keep: int, protected: set[int]) -> list[int]:
        """Delete all but the newest ``keep`` versions, never a protected one (loaded or referenced by routing)."""
        versions = self.versions()
        doomed = [v for v in versions[:-keep] if v not in protected] if keep > 0 else []
        for v in doomed:
            trash = self.root / f".del-v{v}-{_unique()}"
            os.rename(self.path(v), trash)  # readers never see a half-deleted v{N}
            shutil.rmtree(trash, ignore_errors=True)
        if doomed:
            fsync_path(self.root)
        return doomed

    # --- resume state -------------------------------------------------------------------------------------------
    @property
    def state_root(self) -> Path:
        return self.root / STATE_DIR

    def save_state(self, version: int, write_state: Callable[[Path], None], meta: dict) -> None:
        """``trainer-state/v{N}/`` (optimizer, baselines, counters) for the version just published; older ones go."""
        self.state_root.mkdir(exist_ok=True)
        final = self.state_root / f"v{version}"
        tmp = self.state_root / f".tmp-v{version}-{_unique()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        write_state(tmp)
        _write_durably(tmp / STATE_META, json.dumps({**meta, "version": version}).encode())
        for f in tmp.rglob("*"):
            if f.is_file():
                fsync_path(f)
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        fsync_path(self.state_root)
        for p in self.state_root.iterdir():
            m = _VERSION_RE.match(p.name)
            # older states only: a newer one belongs to a trainer that took the lease over from a stale writer
            if ((m and int(m.group(1)) < version) or p.name.startswith(".tmp-")) and p != final:
                shutil.rmtree(p, ignore_errors=True)

    def state_for(self, version: int) -> tuple[Path, dict] | None:
        """The resume state saved with ``version``, if it is complete."""
        d = self.state_root / f"v{version}"
        meta = d / STATE_META
        if not meta.is_file():
            return None
        return d, json.loads(meta.read_text())
