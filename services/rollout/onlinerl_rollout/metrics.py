"""The rollout controller's Prometheus metrics (names are the contract in docs/architecture.md).

Besides decisions and the win probability, the figures each verdict rests on are exported per arm, guardrails
included (suggestion rate, accepted characters per 100 requests, mean shown length, empty and repetition rates), so
a dashboard or alert sees a policy that gets quieter or shorter while its accept rate climbs: the reward hacking the
guardrails exist for.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from onlinerl.arms import CANDIDATE, STABLE

DECISION_KINDS = ("gate_pass", "gate_fail", "promote", "rollback", "hold", "pin", "supersede")
LIVE_FIGURES = (
    "accept_rate",
    "accepted_per_100",
    "suggestion_rate",
    "accepted_chars_per_100",
    "mean_shown_length",
    "empty_rate",
)
"""Figures of ``ArmStats.summary()`` exported for the live comparison (canary, or blue/green watch)."""
GATE_FIGURES = (
    "accept_rate",
    "accepted_per_100",
    "suggestion_rate",
    "accepted_chars_per_100",
    "mean_length",
    "empty_rate",
    "repetition_rate",
)
"""Figures of the gate's ``EvalFigures`` exported for the last gate verdict."""


class RolloutMetrics:
    """One registry per controller, so several controllers (tests, jobs) never share counters."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.decisions = Counter(
            "onlinerl_rollout_decisions_total", "Rollout decisions taken", ["decision"], registry=self.registry
        )
        for kind in DECISION_KINDS:  # export zeros, so alerts on rate() see the series from the start
            self.decisions.labels(kind)
        self.win_probability = Gauge(
            "onlinerl_rollout_candidate_win_probability",
            "P(candidate accept rate >= stable accept rate) of the current canary",
            registry=self.registry,
        )
        self.accept_rate = Gauge(
            "onlinerl_rollout_accept_rate",
            "Accept rate per arm of the current canary",
            ["version", "arm"],
            registry=self.registry,
        )
        self.live_figure = Gauge(
            "onlinerl_rollout_live_figure",
            "Figures of the current candidate and of what it is compared with (stable's arm since the canary "
            "started; under blue/green stable's snapshot at the switch), guardrails included",
            ["version", "arm", "figure"],
            registry=self.registry,
        )
        self.guardrail_breaches = Gauge(
            "onlinerl_rollout_guardrail_breaches",
            "Guardrails the current candidate's point figures break (live: at its last evaluation; gate: last gate)",
            ["source"],
            registry=self.registry,
        )
        self.gate_figure = Gauge(
            "onlinerl_rollout_gate_figure",
            "Eval figures of the last gate verdict per version and arm, guardrails included",
            ["version", "arm", "figure"],
            registry=self.registry,
        )
        self.all_traffic = Gauge(
            "onlinerl_rollout_candidate_has_all_traffic",
            "1 while a blue/green candidate serves everyone (its live watch), 0 otherwise",
            registry=self.registry,
        )

    def observe_canary(
        self,
        candidate: int,
        stable: int,
        p_win: float,
        figures: tuple[Mapping[str, Any], Mapping[str, Any]],
        breaches: int,
        all_traffic: bool = False,
    ) -> None:
        """The live comparison at one tick: ``figures`` = (candidate summary, stable summary) (``ArmStats.summary``)."""
        self.win_probability.set(p_win)
        self.accept_rate.clear()  # drop series of versions no longer in the canary
        self.live_figure.clear()
        for version, arm, fig in ((candidate, CANDIDATE, figures[0]), (stable, STABLE, figures[1])):
            self.accept_rate.labels(str(version), arm).set(float(fig.get("accept_rate", 0.0)))
            for name in LIVE_FIGURES:
                self.live_figure.labels(str(version), arm, name).set(float(fig.get(name, 0.0)))
        self.guardrail_breaches.labels("live").set(breaches)
        self.all_traffic.set(1 if all_traffic else 0)

    def observe_gate(self, candidate: int, stable: int, figures: Mapping[str, Any], breaches: int) -> None:
        """The last gate verdict (``GateResult.figures()``); kept until the next gate."""
        self.gate_figure.clear()
        for version, arm in ((candidate, CANDIDATE), (stable, STABLE)):
            fig = figures.get(arm) or {}
            for name in GATE_FIGURES:
                if isinstance(fig.get(name), int | float):
                    self.gate_figure.labels(str(version), arm, name).set(float(fig[name]))
        self.guardrail_breaches.labels("gate").set(breaches)

    def no_canary(self) -> None:
        self.win_probability.set(float("nan"))
        self.accept_rate.clear()
        self.live_figure.clear()
        self.guardrail_breaches.labels("live").set(0)
        self.all_traffic.set(0)
