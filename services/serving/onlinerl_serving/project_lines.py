"""The reloader's project lines (issue 39): which projects have a policy line of their own, and one reloader each.

A project's own line has its own ``checkpoints`` stream, policy table, holds and version states
(``Keys.for_project``), so following it is what the reloader already does for the shared line, handed the line's
keys: :class:`ProjectLines` keeps one line reloader per project (built by the shared one, sharing its engine, Redis,
metrics and replica id), finds the lines and steps each. Which lines: ``projects.listed`` under ``adapters: listed``;
under ``adapters: all`` also every line in the job's registry (``Keys.lines``, written by the trainer before a line's
first announcement). A line with no announcement yet costs nothing but its place in the one XREAD of every stream.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from onlinerl.config import OnlineRLConfig
from onlinerl.dataplane import lines, versions
from onlinerl.dataplane.holds import active_holds
from onlinerl.keys import Keys

if TYPE_CHECKING:
    from onlinerl_serving.reloader import Reloader

log = logging.getLogger("onlinerl.reloader")


class ProjectLines:
    """Project line reloaders by project, found from the config and the job's line registry."""

    def __init__(self, cfg: OnlineRLConfig, redis: Any, make: Callable[[str], Reloader]) -> None:
        self.cfg = cfg
        self.redis = redis
        self.make = make
        self.lines: dict[str, Reloader] = {}
        self.discover_config()

    def _add(self, names: list[str]) -> None:
        for name in names:
            if name not in self.lines and self.cfg.projects.has_own_line(name):
                self.lines[name] = self.make(name)
                log.info("following project %s's policy line", name)

    def discover_config(self) -> None:
        self._add(list(self.cfg.projects.listed))

    async def discover(self) -> None:
        """Under ``adapters: all``, the lines registered since the last look (one SMEMBERS)."""
        if self.cfg.projects.adapters == "all":
            self._add(await lines.read_async(self.redis, Keys(self.cfg.job)))

    def by_stream(self) -> dict[str, Reloader]:
        """Each line's ``checkpoints`` stream and its reloader: the shared reloader reads them all in one XREAD."""
        return {r.keys.checkpoints: r for r in self.lines.values()}

    async def tick(self, names: set[str]) -> None:
        """Step every line that has versions (``names``: vLLM's model list, read once for all lines). Their policy
        tables and holds are read in one pipelined round trip; a line then costs more only when it loads, retires or
        (under ``direct``) has a version not yet tried for stable."""
        await self.discover()
        active = [r for r in self.lines.values() if r.versions]
        if not active:
            return
        read = await lines.tables_and_holds_async(self.redis, [r.keys for r in active])
        now = time.time()
        for r, (table, raw_holds) in zip(active, read, strict=True):
            try:
                await r.reconcile(names, table, active_holds(raw_holds, now))
            except Exception as exc:  # one line's failure (its folder, its table) must not stop the others
                log.exception("project %s: reconcile failed (retrying): %s", r.line, exc)

    async def keep(self, replica: str) -> None:
        """With each heartbeat: keep this replica's version states of every line with versions alive."""
        for r in self.lines.values():
            if r.versions:
                await versions.keep_async(self.redis, r.keys, replica)

    async def leave(self, replica: str) -> None:
        for r in self.lines.values():
            if r.versions:
                await versions.leave_async(self.redis, r.keys, replica)

    def states(self) -> dict[str, dict[int, str]]:
        """``project -> {version: state}`` for the reloader's /healthz."""
        return {line: {v: s.state for v, s in sorted(r.versions.items())} for line, r in sorted(self.lines.items())}
