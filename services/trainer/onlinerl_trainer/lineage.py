"""Which shared version a new project adapter may start from without another project's code in it (issue 39).

A project's new adapter starts from the shared line's stable weights. But the shared line may have learned from
another project that has (or may get) an adapter of its own: before that project crossed
``projects.minSamplesPerHour`` its samples trained the shared line, and under ``projects.trainShared`` they still do.
Starting from such a version would hand that project's code to the new one: exactly what per-project adapters
promise not to do. So the start is the newest version of the stable's lineage (``parent_version`` down to v0)
below which no version was trained on another such project (each manifest's ``contributors``: tenant -> users of
the samples trained into that version). A version whose manifest is gone or unreadable counts as tainted: isolation
is not assumed. v0 (the seeded fresh LoRA, what the shared adapter started from) is always clean.
"""

from __future__ import annotations

from collections.abc import Callable

from onlinerl.schemas import CheckpointManifest


def clean_start(
    stable: int,
    manifest: Callable[[int], CheckpointManifest],
    project: str,
    isolated: Callable[[str], bool],
) -> tuple[int, str]:
    """``(version, why)``: the newest version in ``stable``'s lineage whose own and older versions hold no tenant
    other than ``project`` for which ``isolated(tenant)`` (a project with its own line), else 0; ``why`` says what
    was skipped ('' when ``stable`` itself is clean). ``manifest(v)`` reads ``v``'s manifest (raises when gone)."""
    chain: list[int] = []  # stable, its parent, ... (newest first)
    tainted_at: dict[int, str] = {}
    version, seen = stable, set()
    while version > 0 and version not in seen:
        seen.add(version)
        chain.append(version)
        try:
            m = manifest(version)
        except Exception as exc:  # pruned or unreadable: its contents cannot be vouched for
            tainted_at[version] = f"v{version}'s manifest cannot be read ({type(exc).__name__})"
            break
        others = sorted(t for t in m.contributors if t != project and isolated(t))
        if others:
            tainted_at[version] = f"v{version} was trained on project(s) {', '.join(others)}"
        version = m.parent_version
    if not tainted_at:
        return stable, ""
    oldest_taint = min(tainted_at)  # every version from it up to stable carries it
    clean = [v for v in chain if v < oldest_taint]
    start = max(clean, default=0)
    return start, f"{tainted_at[oldest_taint]}: starting from v{start}, not shared stable v{stable}"
