"""Run a service as of an older commit next to the current one, so before/after ratios come from the same run."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def checkout_of(ref: str, into: Path, packages: dict[str, str]) -> Path:
    """A directory to put on PYTHONPATH *and run in* (``python -m`` puts the cwd first on sys.path) so that each
    importable name in ``packages`` (name -> folder in the repository) imports as of ``ref``. If ``ref`` did not
    depend on hiredis, it is hidden too, so redis-py uses its own parser as it did then."""
    src = into / "src"
    src.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", ref], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    path = into / "path"
    path.mkdir()
    for name, folder in packages.items():
        nested = src / folder / name  # since c4092ff a component folder holds its package: services/<x>/onlinerl_<x>
        (path / name).symlink_to(nested if nested.is_dir() else src / folder)
    if "hiredis" not in (src / "pyproject.toml").read_text():
        (path / "hiredis.py").write_text('raise ImportError("hiredis is not a dependency at this commit")\n')
    return path
