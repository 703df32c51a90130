"""CPU time and memory of benchmarked processes (Linux /proc): a cost per request that box contention does not inflate,
and the resident memory a server's process tree holds."""

from __future__ import annotations

import os
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


def _stat(pid: int) -> list[str]:
    """Fields of /proc/<pid>/stat after the command name (which may hold spaces and parentheses)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def cpu_seconds(pid: int) -> float:
    """utime + stime of one process."""
    fields = _stat(pid)
    return (int(fields[11]) + int(fields[12])) / _TICK


def tree_pids(pid: int) -> set[int]:
    """``pid`` and its live descendants (a server's worker processes)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int(_stat(int(entry.name))[1])
            except (OSError, IndexError, ValueError):
                continue  # exited while we looked
    tree, frontier = {pid}, [pid]
    while frontier:
        parent = frontier.pop()
        children = [p for p, pp in parents.items() if pp == parent and p not in tree]
        tree.update(children)
        frontier.extend(children)
    return tree


def tree_cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` and its live descendants."""
    total = 0.0
    for p in tree_pids(pid):
        try:
            total += cpu_seconds(p)
        except OSError:
            continue
    return total


def rss_bytes(pid: int) -> int:
    """Resident set size of one process (/proc/<pid>/statm, second field, in pages)."""
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * _PAGE


def tree_rss_bytes(pid: int) -> dict[int, int]:
    """Resident set size of ``pid`` and each live descendant, by pid (pages two processes share count in both)."""
    out: dict[int, int] = {}
    for p in tree_pids(pid):
        try:
            out[p] = rss_bytes(p)
        except OSError:
            continue
    return out
