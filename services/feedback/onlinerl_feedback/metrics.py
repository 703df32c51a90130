"""Prometheus metrics of the feedback service: names and labels exactly as in docs/architecture.md.

With several worker processes (``feedback.workers`` > 1) every worker writes its values to files under
``$PROMETHEUS_MULTIPROC_DIR`` (prometheus_client's multiprocess mode, chosen when that variable is set before the
library is imported), and ``/metrics`` on any worker sums them, so one scrape sees the whole pod.

Per policy line (issue 39): what an outcome counts for is counted on the line that served the rated rollout
(``Decision.line``, the line whose stats it bumps): shown and accepted suggestions, events that rated a rollout by
outcome, and the rewards sent to training. The ``line`` label is ``shared`` or the project
(``onlinerl.metric_lines``: only projects with an adapter of their own have a line; at most ``MAX_NAMED_LINES`` named
per worker, later ones under ``other``).
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from onlinerl.metric_lines import LineLabels

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


class FeedbackMetrics:
    """One registry per app instance (several apps in one test process must not share counters)."""

    def __init__(self, line_labels: LineLabels | None = None) -> None:
        self.registry = CollectorRegistry()
        self.line = line_labels or LineLabels()  # line -> its `line` label value, capped
        self.multiprocess_dir = os.environ.get(MULTIPROC_ENV) or None
        r = self.registry
        # Gauges: every worker refreshes the same backlog figures, so the pod's value is the latest one written.
        gauge_mode = "mostrecent" if self.multiprocess_dir else "all"
        self.secret_findings = Counter(
            "onlinerl_feedback_secret_findings_total",
            "Credentials found in feedback events (privacy.secretScreening): audited secret_detected, never trained.",
            ["kind", "field"],
            registry=r,
        )
        self.events = Counter(
            "onlinerl_feedback_events_total",
            "Feedback events by outcome and tenant.",
            ["outcome", "tenant"],
            registry=r,
        )
        self.shown = Counter(
            "onlinerl_feedback_shown_total",
            "Rated, server-produced, non-empty suggestions, by the version, arm and policy line that served them.",
            ["version", "arm", "line"],
            registry=r,
        )
        self.accepted = Counter(
            "onlinerl_feedback_accepted_total",
            "Accepted suggestions (rate against shown).",
            ["version", "arm", "line"],
            registry=r,
        )
        self.line_events = Counter(
            "onlinerl_feedback_line_events_total",
            "Events that rated a rollout, by outcome and the policy line that served it.",
            ["outcome", "line"],
            registry=r,
        )
        self.rewards = Counter(
            "onlinerl_feedback_rewards_total",
            "Rewards of the samples sent to training per policy line, positive and negative parts apart (a counter "
            "cannot go down): mean reward = (positive - negative) / accepted_for_training line events.",
            ["line", "sign"],
            registry=r,
        )
        self.join_misses = Counter(
            "onlinerl_feedback_join_misses_total", "Events matching no served completion.", ["reason"], registry=r
        )
        self.limited = Counter(
            "onlinerl_feedback_contribution_limited_total",
            "Events audited because their user (API key) is over feedback.limits.maxSamplesPerUserPerHour.",
            ["tenant"],
            registry=r,
        )
        self.quarantined = Counter(
            "onlinerl_feedback_quarantined_total",
            "Events audited because their user is quarantined (accept rate far above or below the tenant's).",
            ["tenant"],
            registry=r,
        )
        self.users_quarantined = Counter(
            "onlinerl_feedback_users_quarantined_total",
            "Users newly quarantined by the anomaly test.",
            ["tenant"],
            registry=r,
        )
        self.continue_events = Counter(
            "onlinerl_feedback_continue_events_total",
            "Stock Continue's dev-data uploads (POST /api/training/data) by event name (Continue's names, else other) "
            "and schema version (0.1.0, 0.2.0, else unknown).",
            ["name", "schema"],
            registry=r,
        )
        self.responses = Counter(
            "onlinerl_feedback_responses_total", "HTTP responses by status code.", ["code"], registry=r
        )
        self.duration = Histogram(
            "onlinerl_feedback_request_duration_seconds",
            "Submit request latency.",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
            registry=r,
        )
        self.backlog = Gauge(
            "onlinerl_feedback_backlog",
            "Unconsumed samples (XLEN samples).",
            registry=r,
            multiprocess_mode=gauge_mode,
        )
        self.consumer_lag = Gauge(
            "onlinerl_feedback_consumer_lag",
            "Samples never delivered to group trainers.",
            registry=r,
            multiprocess_mode=gauge_mode,
        )

    def rated(self, line: str, outcome: str, version: int | None, arm: str, stats: tuple[str, ...]) -> None:
        """One event that rated a rollout ``line`` served: its outcome, and the suggestion counters it bumped."""
        label = self.line(line)
        self.line_events.labels(outcome, label).inc()
        if "shown" in stats:
            self.shown.labels(str(version), arm, label).inc()
            if "accepted" in stats:
                self.accepted.labels(str(version), arm, label).inc()

    def rewarded(self, line: str, reward: float) -> None:
        """One sample sent to training with ``reward``, on ``line``."""
        if reward:
            self.rewards.labels(self.line(line), "positive" if reward > 0 else "negative").inc(abs(reward))

    def exposition(self) -> bytes:
        """The text for ``/metrics``: this process's registry, or every worker's values in multiprocess mode."""
        if self.multiprocess_dir is None:
            return generate_latest(self.registry)
        merged = CollectorRegistry()
        MultiProcessCollector(merged, path=self.multiprocess_dir)
        return generate_latest(merged)
