"""sha256 of files and the check of a folder against a manifest's ``{relative path: sha256}``.

One implementation for the model bootstrap, the trainer (publishing, resume) and the reloader (before it loads).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def file_problems(root: Path, files: Mapping[str, str]) -> list[str]:
    """What is wrong with ``root`` against ``files`` (empty list: every file exists with its recorded sha256)."""
    problems = []
    base = root.resolve()
    for rel, digest in files.items():
        p = (root / rel).resolve()
        if base not in p.parents:
            problems.append(f"manifest file {rel!r} points outside {root}")
        elif not p.is_file():
            problems.append(f"{p} listed in the manifest is missing")
        elif sha256_file(p) != digest:
            problems.append(f"{p} sha256 differs from the manifest (corrupt or still being written)")
    return problems
