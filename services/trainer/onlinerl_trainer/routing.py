"""Which policy line a sample trains (issue 39, per-project adapters): pure rules, and the hourly traffic that opens
a project's own line.

A sample's project is its ``tenant`` (the tenant of the API key that produced it), never its ``line`` field: ``line``
says which line *served* it (for staleness and the PPO ratio's behaviour policy), and a sample that claims another
project's line still trains only its own tenant's lines (:func:`route`, ``Route.claimed_other``). So no sample, forged
or buggy, reaches another project's adapter.

A project with its own line (``projects.has_own_line``) gets an adapter only once ``projects.minSamplesPerHour`` of its
samples arrived within one sliding hour (:class:`HourlyTraffic`, :func:`opens_line`); until then its samples train
the shared adapter. Once open, a line stays open while the trainer runs, also when the project's traffic falls below
the threshold later: its adapter keeps what it learned and its users keep their own policy (closing it would send
them back to a shared policy that, by default, never learned from them). After a restart the lines with a published
version on disk are opened again; a line opened but never published is opened again by its traffic.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass

from onlinerl.config import ProjectsConfig
from onlinerl.keys import SHARED_LINE

HOUR_SECONDS = 3600.0


@dataclass(frozen=True)
class Route:
    """The lines one sample trains, its own project's first, and whether it claimed to be served by another's."""

    lines: tuple[str, ...]
    claimed_other: bool = False


def route(tenant: str, claimed_line: str, open_lines: Collection[str], train_shared: bool) -> Route:
    """The lines a sample of ``tenant`` trains, given the project lines open now.

    - tenant with an open line of its own: that line, and the shared line too only when ``train_shared``;
    - any other tenant: the shared line.
    ``claimed_line`` (the sample's ``line``) never adds a line; a value other than the shared line or the tenant's own
    is reported as ``claimed_other`` (the caller logs and counts it)."""
    claimed_other = claimed_line not in (SHARED_LINE, tenant)
    if tenant != SHARED_LINE and tenant in open_lines:
        lines = (tenant, SHARED_LINE) if train_shared else (tenant,)
    else:
        lines = (SHARED_LINE,)
    return Route(lines, claimed_other)


def served_line(tenant: str, claimed_line: str, open_lines: Collection[str]) -> str:
    """The line whose versions a sample's ``policy_version`` counts on, for its staleness: the line it says served it
    when that is the shared line or its own open line, else the shared line (a claim of another project's line is not
    believed, and a line this trainer does not hold has no version to compare with)."""
    if claimed_line != SHARED_LINE and claimed_line == tenant and claimed_line in open_lines:
        return claimed_line
    return SHARED_LINE


def opens_line(projects: ProjectsConfig, project: str, samples_last_hour: int) -> bool:
    """Whether ``project`` gets its own adapter now: it may have one, and its traffic reached the threshold."""
    return projects.has_own_line(project) and samples_last_hour >= projects.min_samples_per_hour


class HourlyTraffic:
    """Samples per project within the last hour, counted once per stream id (a replayed entry is not traffic again).

    Times are the stream ids' milliseconds (when feedback appended the sample), so a backlog read late still counts
    at the time its users produced it."""

    def __init__(self, window_seconds: float = HOUR_SECONDS) -> None:
        self.window = window_seconds
        self._seen: dict[str, OrderedDict[str, float]] = {}

    def add(self, project: str, sample_id: str, at: float, now: float) -> int:
        """Count ``sample_id`` (appended at ``at``, unix s) for ``project``; returns its samples within the hour
        before ``now``."""
        seen = self._seen.setdefault(project, OrderedDict())
        if sample_id not in seen:
            seen[sample_id] = at
        return self.count(project, now)

    def count(self, project: str, now: float) -> int:
        seen = self._seen.get(project)
        if not seen:
            return 0
        horizon = now - self.window
        for sid in [s for s, at in seen.items() if at < horizon]:
            del seen[sid]
        return len(seen)

    def forget(self, project: str) -> None:
        """The project's line is open: its traffic no longer needs counting."""
        self._seen.pop(project, None)


def stream_id_seconds(sample_id: str) -> float:
    """The unix time (s) a Redis stream id was appended at (its milliseconds part)."""
    ms, _, _ = sample_id.partition("-")
    try:
        return int(ms) / 1000.0
    except ValueError:
        return 0.0
