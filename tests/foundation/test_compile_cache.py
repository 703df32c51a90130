"""The engines' torch.compile cache: private per engine, seeded from the shared folder, published back file by file."""

from __future__ import annotations

import os
from pathlib import Path

from onlinerl import compile_cache


def _tree(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): p.read_text() for p in root.rglob("*") if p.is_file()}


def test_a_new_engine_starts_from_what_earlier_engines_published_and_keeps_its_own(tmp_path: Path) -> None:
    first = tmp_path / "a" / "torchinductor-101"
    (first / "ab" / "locks").mkdir(parents=True)
    (first / "ab" / "kernel.cpp").write_text("compiled once")
    (first / "ab" / "locks" / "kernel.lock").write_text("held by engine 101")
    shared = tmp_path / "shared"
    assert compile_cache.publish(first, shared) == 1  # the lock stays with its process
    assert _tree(shared) == {"ab/kernel.cpp": "compiled once"}

    second = compile_cache.private_folder(tmp_path / "b", 202, shared)
    assert second == tmp_path / "b" / "torchinductor-202" and _tree(second) == {"ab/kernel.cpp": "compiled once"}
    (second / "cd").mkdir()
    (second / "cd" / "other.cpp").write_text("compiled by 202")
    (second / "ab" / "kernel.cpp").write_text("202's own copy")  # never overwrites what the shared folder holds
    assert compile_cache.publish(second, shared) == 1
    assert _tree(shared) == {"ab/kernel.cpp": "compiled once", "cd/other.cpp": "compiled by 202"}
    assert not [p for p in shared.rglob(".*tmp*")]  # every file arrived by rename, nothing half-written is left


def test_without_a_shared_folder_each_engine_keeps_to_its_own(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv(compile_cache.SHARED_ENV, raising=False)
    assert compile_cache.shared_folder() is None
    assert compile_cache.private_folder(tmp_path, 7) == tmp_path / "torchinductor-7"
    assert compile_cache.publish(tmp_path / "torchinductor-7") == 0
    monkeypatch.setenv(compile_cache.SHARED_ENV, str(tmp_path / "s"))
    assert compile_cache.shared_folder() == tmp_path / "s"
    assert os.environ[compile_cache.SHARED_ENV] == str(tmp_path / "s")
