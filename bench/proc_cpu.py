"""CPU time of benchmarked processes (Linux /proc): a cost per request that box contention does not inflate."""

from __future__ import annotations

import os
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> list[str]:
    """Fields of /proc/<pid>/stat after the command name (which may hold spaces and parentheses)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def cpu_seconds(pid: int) -> float:
    """utime + stime of one process."""
    fields = _stat(pid)
    return (int(fields[11]) + int(fields[12])) / _TICK


def tree_cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` and its live descendants (a server's worker processes)."""
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
    total = 0.0
    for p in tree:
        try:
            total += cpu_seconds(p)
        except OSError:
            continue
    return total
