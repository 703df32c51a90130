"""Policy lines on disk and in vLLM (issue 39): where a line's checkpoints live and what its adapters are named.

The shared policy's line keeps the names it always had (``{checkpointDir}/{job}/v{N}``, adapter ``{job}-v{N}``). A
project's own line lives under ``{checkpointDir}/{job}/projects/{project}/v{N}`` and its adapters are named
``{job}@{project}-v{N}``: ``@`` is in neither a job name nor a tenant name, so a name parses back to exactly one
line and version, and no project's adapter can be mistaken for the shared policy's or another project's.
Redis keys of a line: ``onlinerl.keys.Keys.for_project``.
"""

from __future__ import annotations

from pathlib import Path

from onlinerl.keys import SHARED_LINE, tenant_problem

PROJECTS_DIR = "projects"


def checkpoint_root(checkpoint_dir: str | Path, job: str, line: str = SHARED_LINE) -> Path:
    """The folder holding one line's ``v{N}`` checkpoints."""
    root = Path(checkpoint_dir) / job
    if not line:
        return root
    problem = tenant_problem(line)
    if problem:
        raise ValueError(problem)
    return root / PROJECTS_DIR / line


def adapter_name(job: str, version: int, line: str = SHARED_LINE) -> str:
    """The vLLM model name a line's version is served under: unique per line and version, never reused."""
    return f"{job}@{line}-v{version}" if line else f"{job}-v{version}"


def parse_adapter_name(job: str, model: str) -> tuple[str, int] | None:
    """``(line, version)`` of one of this job's adapter names, else None (the inverse of :func:`adapter_name`)."""
    if model.startswith(f"{job}@"):
        line, sep, version = model[len(job) + 1 :].rpartition("-v")
        if sep and version.isdigit() and tenant_problem(line) is None:
            return line, int(version)
        return None
    prefix = f"{job}-v"
    if model.startswith(prefix) and model[len(prefix) :].isdigit():
        return SHARED_LINE, int(model[len(prefix) :])
    return None
