"""The rollout of every policy line (issue 39): the shared policy's and each project's own adapter line.

Each line is judged by its own :class:`~onlinerl_rollout.controller.RolloutController`, handed that line's keys
(``Keys.for_project``): its own gate (on the project's held-out samples where it has them: gate_eval.py), its own
canary against what that project is served now, the same guardrails, per-user cap and statistics, and its own
rollback, pin and hold (``onlinerl policy --project P``). Nothing of one line is read or written by another's tick, so
a rollback of one project's line leaves every other line as it was.

Which lines: the shared one always; under ``projects.adapters: listed`` the listed projects; under ``all`` every
project line registered in ``Keys.lines`` (the trainer registers a line before it announces the line's first
version) and the listed ones. Lines are found again at every tick, so a new project's line is judged from its first
version on, without a restart.

Cost per tick, with L lines and R live serving replicas: one SMEMBERS (under ``all``), one TIME and one ZRANGEBYSCORE
(the live replicas), and one pipeline of L x (2 + R) HGETALLs (each line's policy table, verdicts and version states):
three or four round trips whatever L. A line with nothing to do (no candidate, no version to gate) costs nothing
more. A line with a running canary reads its verdict, its two arms' counters and their per-user ledgers (about six
round trips, as the single-line controller always did) and writes only when it decides; a line with a version to gate
runs its gate. Gates run one at a time (the evaluator drives the serving path): a tick in which a gate ran reads the
remaining lines again before judging them, so no line acts on a table older than ``stale_after_seconds``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import redis
from prometheus_client import Counter, Gauge

from onlinerl.arms import CANDIDATE, STABLE
from onlinerl.config import ProjectsConfig, RolloutConfig
from onlinerl.dataplane import lines as dataplane_lines
from onlinerl.keys import SHARED_LINE, Keys
from onlinerl.metric_lines import OTHER_LABEL, LineLabels
from onlinerl.rollout.records import DecisionRecord
from onlinerl_rollout.controller import DecisionHook, Evaluator, RolloutController, run_ticks
from onlinerl_rollout.metrics import DECISION_KINDS, RolloutMetrics

log = logging.getLogger("onlinerl_rollout")

LineDecisionHook = Callable[[str, DecisionRecord], None]
Figures = tuple[Mapping[str, Any], Mapping[str, Any]]  # a canary's (candidate summary, stable summary)


class LineMetrics:
    """Project lines' metrics next to the shared line's (whose series stay as they were): decisions summed over the
    project lines, how many lines are judged and how many run a canary, and each line's running canary (its P(candidate
    better) and its two arms' accept rates) under a ``line`` label. Only those two per-line figures: every figure per
    line would make L series per figure; a project's others are in `onlinerl status` and its decisions stream. The
    label is ``onlinerl.metric_lines``'s: at most ``MAX_NAMED_LINES`` projects by name, taken by the first lines that
    run a canary (an idle line takes none); a canary beyond them is not exported (a P(win) of "some other line" means
    nothing). A line's series go when its canary ends."""

    def __init__(self, metrics: RolloutMetrics, labels: LineLabels | None = None) -> None:
        reg = metrics.registry
        self.label = labels or LineLabels()
        self._exported: set[str] = set()  # labels with canary series now
        self.decisions = Counter(
            "onlinerl_rollout_project_decisions_total",
            "Rollout decisions taken on project policy lines (all projects together)",
            ["decision"],
            registry=reg,
        )
        for kind in DECISION_KINDS:
            self.decisions.labels(kind)
        self.lines = Gauge(
            "onlinerl_rollout_project_lines", "Project policy lines judged at the last tick", registry=reg
        )
        self.canaries = Gauge(
            "onlinerl_rollout_project_canaries", "Project policy lines with a candidate at the last tick", registry=reg
        )
        self.win_probability = Gauge(
            "onlinerl_rollout_line_win_probability",
            "P(candidate accept rate >= stable's) of each policy line's running canary",
            ["line"],
            registry=reg,
        )
        self.accept_rate = Gauge(
            "onlinerl_rollout_line_accept_rate",
            "Accept rate of each policy line's canary arms (the candidate and what it is compared with)",
            ["line", "arm"],
            registry=reg,
        )

    def canary(self, line: str, p_win: float, figures: Figures) -> None:
        """``line``'s canary at one tick: ``figures`` = (candidate summary, stable summary), as observe_canary."""
        label = self.label(line)
        if label == OTHER_LABEL:
            return
        self.win_probability.labels(label).set(p_win)
        for arm, fig in ((CANDIDATE, figures[0]), (STABLE, figures[1])):
            self.accept_rate.labels(label, arm).set(float(fig.get("accept_rate", 0.0)))
        self._exported.add(label)

    def no_canary(self, line: str) -> None:
        """``line`` runs no canary (now): its series go (called for every idle line at every tick: a set lookup)."""
        label = self.label.known(line)
        if label is None or label not in self._exported:
            return
        self._exported.discard(label)
        self.win_probability.remove(label)
        for arm in (CANDIDATE, STABLE):
            self.accept_rate.remove(label, arm)


class LineRolloutMetrics(RolloutMetrics):
    """One line's controller metrics: what ``inner`` records (the shared line: the exported series it always had;
    the project lines: one private, unexported registry for all of them), and the line's canary in
    :class:`LineMetrics`' per-line gauges. Shares ``inner``'s series (no registration of its own)."""

    def __init__(self, inner: RolloutMetrics, per_line: LineMetrics, line: str) -> None:  # no super(): inner's series
        self.__dict__.update(inner.__dict__)
        self._per_line, self._line = per_line, line

    def observe_canary(self, candidate: int, stable: int, p_win: float, figures: Figures, *rest: Any) -> None:
        """As :meth:`RolloutMetrics.observe_canary` (``rest``: its breaches and all_traffic), then the line's own."""
        super().observe_canary(candidate, stable, p_win, figures, *rest)
        self._per_line.canary(self._line, p_win, figures)

    def no_canary(self) -> None:
        super().no_canary()
        self._per_line.no_canary(self._line)


class LinesController:
    """Ticks the shared line's controller and one controller per project line, in one pass over the lines."""

    def __init__(
        self,
        r: redis.Redis,
        job: str,
        cfg: RolloutConfig,
        projects: ProjectsConfig,
        evaluator: Evaluator | None = None,
        *,
        clock: Callable[[], float] = time.time,
        on_decision: Iterable[LineDecisionHook] = (),
        metrics: RolloutMetrics | None = None,
        gate_attempts: int = 3,
        gate_retry_seconds: float = 2.0,
        stale_after_seconds: float = 5.0,
    ) -> None:
        self.r = r
        self.job = job
        self.keys = Keys(job)
        self.cfg = cfg
        self.projects = projects
        self.evaluator = evaluator
        self.clock = clock
        self.on_decision = list(on_decision)
        self.metrics = metrics or RolloutMetrics()
        self.line_metrics = LineMetrics(self.metrics)
        self._project_metrics = RolloutMetrics()
        self.gate_attempts = gate_attempts
        self.gate_retry_seconds = gate_retry_seconds
        self.stale_after_seconds = stale_after_seconds
        self.controllers: dict[str, RolloutController] = {
            SHARED_LINE: self._controller(SHARED_LINE, LineRolloutMetrics(self.metrics, self.line_metrics, SHARED_LINE))
        }
        self.last_tick_ok: float | None = None

    @property
    def shared(self) -> RolloutController:
        return self.controllers[SHARED_LINE]

    @property
    def evaluating(self) -> int | None:
        """The version under eval on any line (an eval can take minutes: the process is still healthy)."""
        return next((c.evaluating for c in self.controllers.values() if c.evaluating is not None), None)

    def _controller(self, line: str, metrics: RolloutMetrics) -> RolloutController:
        hooks: list[DecisionHook] = [lambda rec, line=line: self._decided(line, rec)]
        return RolloutController(
            self.r,
            self.job,
            self.cfg,
            self.evaluator,
            clock=self.clock,
            on_decision=hooks,
            metrics=metrics,
            gate_attempts=self.gate_attempts,
            gate_retry_seconds=self.gate_retry_seconds,
            line=line,
        )

    def _decided(self, line: str, rec: DecisionRecord) -> None:
        if line:
            self.line_metrics.decisions.labels(rec.decision).inc()
        for hook in self.on_decision:
            try:
                hook(line, rec)
            except Exception:
                log.exception("on_decision hook failed for %s on line %r", rec.decision, line)

    def project_lines(self) -> list[str]:
        """The project lines to judge now (see the module doc); sorted."""
        mode = self.projects.adapters
        if mode == "off":
            return []
        found = set(self.projects.listed)
        if mode == "all":
            found |= set(dataplane_lines.read(self.r, self.keys))
        return sorted(found)

    def line(self, name: str) -> RolloutController:
        """The controller of ``name``'s line (made on first use: its gate retries and activity are its own)."""
        ctl = self.controllers.get(name)
        if ctl is None:
            # a project line's figures are not exported series by series (LineMetrics): one private, unexported
            # registry for all of them (a registry per line made the first tick over 1,000 lines ~0.4 s slower)
            metrics = LineRolloutMetrics(self._project_metrics, self.line_metrics, name)
            ctl = self.controllers[name] = self._controller(name, metrics)
        return ctl

    def tick(self) -> list[tuple[str, DecisionRecord]]:
        """One pass over every line; returns ``(line, decision)`` for each decision recorded in it."""
        if not self.cfg.controlled:
            self.last_tick_ok = time.monotonic()
            return []
        names = [SHARED_LINE, *self.project_lines()]
        out: list[tuple[str, DecisionRecord]] = []
        read_at = time.monotonic()
        unseen = {name for name in names if name not in self.controllers or self.controllers[name].said is None}
        views = dataplane_lines.views(self.r, self.job, names, unseen)
        canaries = 0
        for i, name in enumerate(names):
            if time.monotonic() - read_at > self.stale_after_seconds:  # a gate ran meanwhile: read the rest again
                read_at = time.monotonic()
                views.update(dataplane_lines.views(self.r, self.job, names[i:], unseen))
            view = views[name]
            canaries += bool(name) and view.table.candidate is not None
            out += [(name, rec) for rec in self.line(name).tick(view)]
        self.line_metrics.lines.set(len(names) - 1)
        self.line_metrics.canaries.set(canaries)
        self.last_tick_ok = time.monotonic()
        return out

    def run(self, stop: threading.Event, interval: float = 5.0) -> None:
        """Tick every ``interval`` s until ``stop`` is set (``controller.run_ticks``)."""
        run_ticks(self.tick, stop, interval)
