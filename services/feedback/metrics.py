"""Prometheus metrics of the feedback service: names and labels exactly as in docs/architecture.md."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class FeedbackMetrics:
    """One registry per app instance (several apps in one test process must not share counters)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.events = Counter(
            "onlinerl_feedback_events_total",
            "Feedback events by outcome and tenant.",
            ["outcome", "tenant"],
            registry=r,
        )
        self.shown = Counter(
            "onlinerl_feedback_shown_total",
            "Rated, server-produced, non-empty suggestions.",
            ["version", "arm"],
            registry=r,
        )
        self.accepted = Counter(
            "onlinerl_feedback_accepted_total",
            "Accepted suggestions (rate against shown).",
            ["version", "arm"],
            registry=r,
        )
        self.join_misses = Counter(
            "onlinerl_feedback_join_misses_total", "Events matching no served completion.", ["reason"], registry=r
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
        self.backlog = Gauge("onlinerl_feedback_backlog", "Unconsumed samples (XLEN samples).", registry=r)
        self.consumer_lag = Gauge(
            "onlinerl_feedback_consumer_lag", "Samples never delivered to group trainers.", registry=r
        )
