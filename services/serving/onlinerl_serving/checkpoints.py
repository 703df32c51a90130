"""Checkpoint announcements (the ``checkpoints`` stream) and their verification against ``manifest.json``.

A version is loaded only if the manifest's own sha256 equals the announced one and every file listed in it has
the listed sha256: a half-copied or tampered directory is refused, never served.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from onlinerl.checksums import file_problems, sha256_file
from onlinerl.schemas import CheckpointManifest


class CheckpointError(ValueError):
    """The announced checkpoint cannot be used; the message says what is wrong with it."""


@dataclass(frozen=True)
class Announcement:
    """One ``checkpoints`` stream entry."""

    entry_id: str
    version: int
    path: str
    kind: str
    manifest_sha256: str

    @classmethod
    def from_entry(cls, entry_id: Any, fields: dict[Any, Any]) -> Announcement:
        f = {_s(k): _s(v) for k, v in fields.items()}
        try:
            return cls(_s(entry_id), int(f["version"]), f["path"], f.get("kind", "lora"), f.get("manifest_sha256", ""))
        except (KeyError, ValueError) as exc:
            raise CheckpointError(f"malformed checkpoints entry {_s(entry_id)}: {f} ({exc})") from None


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def verify_checkpoint(ann: Announcement, job: str) -> CheckpointManifest:
    """Check the directory against its manifest (blocking file I/O: run it in a thread)."""
    root = Path(ann.path)
    if root.name.startswith(".") or root.name != f"v{ann.version}":
        raise CheckpointError(f"{root} is not a published version directory (expected .../v{ann.version})")
    manifest_path = root / "manifest.json"
    if not manifest_path.is_file():
        raise CheckpointError(f"{manifest_path} is missing")
    if ann.manifest_sha256 and sha256_file(manifest_path) != ann.manifest_sha256:
        raise CheckpointError(f"{manifest_path} sha256 differs from the announced manifest_sha256")
    try:
        manifest = CheckpointManifest.from_json(manifest_path.read_bytes())
    except ValueError as exc:
        raise CheckpointError(f"{manifest_path} is not a valid manifest: {exc}") from None
    if manifest.job != job or manifest.version != ann.version or manifest.kind != ann.kind:
        raise CheckpointError(
            f"{manifest_path} says job={manifest.job} v{manifest.version} {manifest.kind}; "
            f"announced job={job} v{ann.version} {ann.kind}"
        )
    if not manifest.files:
        raise CheckpointError(f"{manifest_path} lists no files")
    problems = file_problems(root, manifest.files)
    if problems:
        raise CheckpointError(problems[0])
    return manifest
