"""What the operator reads of the project policy lines (issue 39): their policy tables for status, their new rollout
decisions for Events.

Which lines: ``projects.listed`` and the job's registry ``Keys.lines`` (``onlinerl.dataplane.lines``), as `onlinerl
status` shows them; none under ``projects.adapters: off`` (then nothing is read). One pass costs two round trips
whatever the number of lines: the registry, then one MULTI/EXEC with the server's TIME, the policy tables of the lines
status shows (the first :data:`MAX_SHOWN` by name) and every line's decisions stream.

One cursor for all lines, not one per line: status stays small with a thousand lines. It is a stream id, exclusive:
the next pass reads each line's decisions after it. Stream ids are the Redis server's clock in milliseconds, and the
reads are one snapshot (MULTI), so every decision appended after it carries an id at or above the snapshot's
millisecond: the cursor moves to just below that millisecond. A decision of the snapshot's very millisecond is read
again by the next pass and posted again, which the Event's name (the decision's line and stream id) turns into a 409,
not a copy. (A Redis clock set back can put a new id below the cursor: that decision gets no Event; its line's table
in status is still right.) When a pass meets more than it reports (a line with :data:`PER_LINE` or more new
decisions, or more than :data:`MAX_EVENTS` in all, after an operator outage) it reports the oldest ones and the
cursor stops at the last it reported, so nothing is skipped.

The picking (:func:`pick`) is pure, so its rules are unit-tested.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from onlinerl.config import ProjectsConfig
from onlinerl.dataplane import decisions
from onlinerl.dataplane import lines as dataplane_lines
from onlinerl.keys import Keys
from onlinerl.rollout.records import DecisionRecord
from onlinerl.schemas import PolicyTable

MAX_SHOWN = 50  # lines in status.projects (by name); `onlinerl status` shows every one
PER_LINE = 20  # decisions read per line and pass
MAX_EVENTS = 50  # project-line Events posted per pass
_MAX_SEQ = 2**64 - 1

Decided = tuple[str, str, DecisionRecord]  # (line, stream id, record)


@dataclass
class ProjectLinesView:
    """One pass over the project lines: every line's name, the shown lines' tables, the decisions to report."""

    names: list[str] = field(default_factory=list)
    tables: dict[str, PolicyTable] = field(default_factory=dict)
    decisions: list[Decided] = field(default_factory=list)  # oldest first
    cursor: str | None = None  # the next pass reports decisions after this stream id (None: lines off / none yet)


def stream_id(entry_id: str) -> tuple[int, int]:
    """``"ms-seq"`` as a sortable pair."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def before_ms(ms: int) -> str:
    """The largest stream id below millisecond ``ms``: an exclusive cursor that still reads all of ``ms``."""
    return f"{ms - 1}-{_MAX_SEQ}" if ms > 0 else "0-0"


def pick(
    per_line: dict[str, list[tuple[str, DecisionRecord]]],
    after: str | None,
    snapshot_ms: int,
    per_line_limit: int = PER_LINE,
    cap: int = MAX_EVENTS,
) -> tuple[list[Decided], str]:
    """The decisions to report this pass, oldest first, and the cursor for the next one (see the module doc).

    ``per_line``: each line's decisions as read, oldest first: after ``after`` (at most ``per_line_limit`` each), or,
    on first sight (``after`` None), each line's newest; then only the newest ``cap`` of all lines are reported."""
    every = sorted(
        ((stream_id(i), line, i, rec) for line, entries in per_line.items() for i, rec in entries),
        key=lambda e: (e[0], e[1]),
    )
    if after is None:
        return [(line, i, rec) for _, line, i, rec in every[-cap:]], before_ms(snapshot_ms)
    # A line that filled its read may hold more: nothing newer than its last read id is complete yet.
    full = [stream_id(entries[-1][0]) for entries in per_line.values() if len(entries) >= per_line_limit]
    bound = min(full) if full else None
    if bound is not None:
        every = [e for e in every if e[0] <= bound]
    if len(every) > cap:  # the oldest cap, and every other line's decision of the same id (the cursor is exclusive)
        last = every[cap - 1][0]
        every = [e for e in every if e[0] <= last]
        bound = last
    cursor = before_ms(snapshot_ms) if bound is None else f"{bound[0]}-{bound[1]}"
    return [(line, i, rec) for _, line, i, rec in every], cursor


async def read(r: Any, job: str, projects: ProjectsConfig, after: str | None) -> ProjectLinesView:
    """The project lines' view for one pass, on an asyncio client (the module doc: two round trips)."""
    if projects.adapters == "off":
        return ProjectLinesView()
    keys = Keys(job)
    names = sorted(set(projects.listed) | set(await dataplane_lines.read_async(r, keys)))
    if not names:
        return ProjectLinesView(cursor=after)
    shown = names[:MAX_SHOWN]
    snapshot_ms, tables, raw = await dataplane_lines.tables_and_decisions_async(r, job, shown, names, after, PER_LINE)
    per_line = {name: decisions.records(entries) for name, entries in raw.items()}
    picked, cursor = pick(per_line, after, snapshot_ms)
    return ProjectLinesView(names=names, tables=tables, decisions=picked, cursor=cursor)
