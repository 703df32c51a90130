"""Checkpoint announcements (the ``checkpoints`` stream) and their verification against ``manifest.json``.

Anyone who can write the stream can announce anything, so nothing in an announcement is trusted (issue 17): its path
must be exactly the announced version's folder on the stream's policy line (``onlinerl.lines.checkpoint_root``:
``{storage.checkpointDir}/{job}/v{N}`` for the shared line, ``{...}/{job}/projects/{project}/v{N}`` for a project's
own line, issue 39), lexically (no ``..``, no other folder) and once resolved (no symlink on the way leads elsewhere;
the checkpoint folder itself may be a mount's symlink). A version is loaded only if, besides, the manifest's own sha256
equals the announced one, it names the same job, line, version and kind, and every file listed in it stays inside the
folder and has the listed sha256: a half-copied, tampered or misplaced directory, or another line's checkpoint, is
refused, never served. Each refusal carries a ``reason`` for the metric
``onlinerl_reloader_refused_announcements_total{reason}``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from onlinerl.checksums import file_problems, sha256_file
from onlinerl.keys import SHARED_LINE
from onlinerl.lines import checkpoint_root
from onlinerl.schemas import CheckpointManifest

# Reasons of a refused announcement (metric label): stream entry, path, manifest, files.
MALFORMED = "malformed"
PATH_TRAVERSAL = "path_traversal"
OUTSIDE = "outside_checkpoint_dir"
WRONG_VERSION = "wrong_version"
SYMLINK_ESCAPE = "symlink_escape"
MANIFEST = "manifest_invalid"
MANIFEST_MISMATCH = "manifest_mismatch"
CHECKSUM = "checksum_mismatch"


class CheckpointError(ValueError):
    """The announced checkpoint cannot be used; the message says what is wrong with it, ``reason`` names it."""

    def __init__(self, message: str, reason: str = MANIFEST) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Announcement:
    """One ``checkpoints`` stream entry."""

    entry_id: str
    version: int
    path: str
    kind: str
    manifest_sha256: str
    rollback_at: float = 0.0  # the manual rollback the version's lineage follows (0.0: none, or an older trainer)

    @classmethod
    def from_entry(cls, entry_id: Any, fields: dict[Any, Any]) -> Announcement:
        f = {_s(k): _s(v) for k, v in fields.items()}
        try:
            return cls(
                _s(entry_id),
                int(f["version"]),
                f["path"],
                f.get("kind", "lora"),
                f.get("manifest_sha256", ""),
                float(f.get("rollback_at") or 0.0),
            )
        except (KeyError, ValueError) as exc:
            raise CheckpointError(f"malformed checkpoints entry {_s(entry_id)}: {f} ({exc})", MALFORMED) from None


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def confine(ann: Announcement, checkpoint_dir: str | Path, job: str, line: str = SHARED_LINE) -> Path:
    """The announced folder if it is ``line``'s folder of the announced N (``{checkpoint_dir}/{job}/v{N}`` for the
    shared line, ``{checkpoint_dir}/{job}/projects/{line}/v{N}`` for a project's), else CheckpointError.

    Lexically the path may be the configured form or the resolved one (the trainer announces the resolved path);
    resolved, it must be the resolved checkpoint folder + the line's ``.../v{N}``: a symlinked ``{job}``, project
    folder or ``v{N}`` (or any symlink of the announced path) that leads elsewhere is refused, and so is another
    line's folder (a project's checkpoint announced on the shared stream or another project's). Cheap (no file is
    read): run at registration."""
    announced = Path(ann.path)
    if ".." in announced.parts:
        raise CheckpointError(f"announced path {ann.path!r} contains '..'", PATH_TRAVERSAL)
    base = Path(os.path.abspath(checkpoint_dir))
    real_base = base.resolve()
    root, real_root = checkpoint_root(base, job, line), checkpoint_root(real_base, job, line)
    name = f"v{ann.version}"
    here = Path(os.path.abspath(announced))
    if here.parent not in (root, real_root):
        raise CheckpointError(f"announced path {ann.path!r} is not inside {root}", OUTSIDE)
    if here.name != name:
        raise CheckpointError(
            f"announced path {ann.path!r} is not the folder of v{ann.version} ({name})", WRONG_VERSION
        )
    try:
        real = here.resolve()
    except (OSError, RuntimeError, ValueError) as exc:  # a symlink loop, a NUL byte, a name too long
        raise CheckpointError(f"announced path {ann.path!r} cannot be resolved: {exc}", SYMLINK_ESCAPE) from None
    if real != real_root / name:
        raise CheckpointError(f"announced path {ann.path!r} resolves to {real}, outside {real_root}", SYMLINK_ESCAPE)
    return here


def validate(ann: Announcement, checkpoint_dir: str | Path, job: str, line: str = SHARED_LINE) -> CheckpointManifest:
    """Everything the reloader checks before it loads: place (``confine``), then contents (``verify_checkpoint``)."""
    confine(ann, checkpoint_dir, job, line)
    return verify_checkpoint(ann, job, line)


def verify_checkpoint(ann: Announcement, job: str, line: str = SHARED_LINE) -> CheckpointManifest:
    """Check the directory against its manifest (blocking file I/O: run it in a thread). The manifest must name the
    line it was announced on: a project's adapter never loads as the shared policy's or another project's."""
    root = Path(ann.path)
    if root.name.startswith(".") or root.name != f"v{ann.version}":
        raise CheckpointError(
            f"{root} is not a published version directory (expected .../v{ann.version})", WRONG_VERSION
        )
    manifest_path = root / "manifest.json"
    if not manifest_path.is_file():
        raise CheckpointError(f"{manifest_path} is missing")
    if ann.manifest_sha256 and sha256_file(manifest_path) != ann.manifest_sha256:
        raise CheckpointError(f"{manifest_path} sha256 differs from the announced manifest_sha256", CHECKSUM)
    try:
        manifest = CheckpointManifest.from_json(manifest_path.read_bytes())
    except ValueError as exc:
        raise CheckpointError(f"{manifest_path} is not a valid manifest: {exc}") from None
    said = (manifest.job, manifest.line, manifest.version, manifest.kind)
    if said != (job, line, ann.version, ann.kind):
        said_line = f" line={manifest.line}" if manifest.line else ""  # a project's line; the shared one unnamed
        ann_line = f" line={line}" if line else ""
        raise CheckpointError(
            f"{manifest_path} says job={manifest.job}{said_line} v{manifest.version} {manifest.kind}; "
            f"announced job={job}{ann_line} v{ann.version} {ann.kind}",
            MANIFEST_MISMATCH,
        )
    if not manifest.files:
        raise CheckpointError(f"{manifest_path} lists no files")
    base = root.resolve()
    for rel in manifest.files:
        if base not in (root / rel).resolve().parents:
            raise CheckpointError(f"manifest file {rel!r} resolves outside {root}", SYMLINK_ESCAPE)
    problems = file_problems(root, manifest.files)
    if problems:
        raise CheckpointError(problems[0], CHECKSUM)
    return manifest
