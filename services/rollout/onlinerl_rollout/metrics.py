"""The rollout controller's Prometheus metrics (names are the contract in docs/architecture.md)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from onlinerl.arms import CANDIDATE, STABLE

DECISION_KINDS = ("gate_pass", "gate_fail", "promote", "rollback", "hold", "pin", "supersede")


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

    def observe_canary(
        self, candidate: int, stable: int, p_win: float, candidate_rate: float, stable_rate: float
    ) -> None:
        self.win_probability.set(p_win)
        self.accept_rate.clear()  # drop series of versions no longer in the canary
        self.accept_rate.labels(str(candidate), CANDIDATE).set(candidate_rate)
        self.accept_rate.labels(str(stable), STABLE).set(stable_rate)

    def no_canary(self) -> None:
        self.win_probability.set(float("nan"))
        self.accept_rate.clear()
