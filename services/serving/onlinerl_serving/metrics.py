"""Prometheus metrics of the gateway and the reloader. Names and labels are a contract (docs/architecture.md).

Per policy line (issue 39): the served completions and the policy tables carry a ``line`` label
(``onlinerl.metric_lines``: ``shared``, or the project; bounded by the keys file and capped per process).
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from onlinerl.keys import SHARED_LINE
from onlinerl.metric_lines import OTHER_LABEL, LineLabels
from onlinerl.schemas import PolicyTable

# Sub-millisecond buckets: the gateway's own overhead is the figure we promise (<= 2 ms at p50).
_OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1)
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None, line_labels: LineLabels | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.line = line_labels or LineLabels()  # line -> its `line` label value, capped
        r = self.registry
        self.requests = Counter(
            "onlinerl_serving_requests_total",
            "Completion requests by outcome.",
            ["tenant", "arm", "version", "code"],
            registry=r,
        )
        self.duration = Histogram(
            "onlinerl_serving_request_duration_seconds",
            "Request time at the gateway.",
            ["stream"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "onlinerl_serving_ttft_seconds",
            "Time to the first streamed token chunk.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.overhead = Histogram(
            "onlinerl_serving_gateway_overhead_seconds",
            "Time spent in the gateway itself (parse, route, relay, record).",
            buckets=_OVERHEAD_BUCKETS,
            registry=r,
        )
        self.inflight = Gauge("onlinerl_serving_inflight_requests", "Completions in progress.", registry=r)
        self.recorded = Counter(
            "onlinerl_serving_rollouts_recorded_total",
            "Rollout records stored (served completions), by the version and arm of their policy line.",
            ["version", "arm", "line"],
            registry=r,
        )
        self.record_errors = Counter(
            "onlinerl_serving_rollout_record_errors_total",
            "Completions served whose rollout record could not be stored.",
            registry=r,
        )
        self.records_evicted = Counter(
            "onlinerl_serving_rollout_records_evicted_total",
            "Rollout records evicted because their tenant was over serving.maxRecordsPerTenant (oldest first).",
            ["tenant"],
            registry=r,
        )
        self.engine_up = Gauge("onlinerl_serving_engine_up", "1 when vLLM answers /v1/models.", registry=r)
        self.engine_calls = Counter(
            "onlinerl_serving_engine_calls_total",
            "Completion requests handed to vLLM, by how they reached it: socket (sidecar), asgi (vLLM's app in its "
            "process), direct (its completion handler called as a function, non-streaming in its process).",
            ["via"],
            registry=r,
        )
        self.policy_version = Gauge(
            "onlinerl_serving_policy_version",
            "Versions in the cached policy table of each policy line routed here (-1: none).",
            ["role", "line"],
            registry=r,
        )
        self.canary_share = Gauge(
            "onlinerl_serving_canary_share",
            "Share of a policy line's users (or requests) its table sends to the candidate (0 without one).",
            ["line"],
            registry=r,
        )

    def observe_tables(self, shared: PolicyTable, lines: Mapping[str, PolicyTable]) -> None:
        """The policy tables at a scrape: the shared one and each project line's routed here (a line no longer
        routed here loses its series; a line over the label cap has none: a version summed over lines means
        nothing)."""
        self.policy_version.clear()
        self.canary_share.clear()
        for line, table in ((SHARED_LINE, shared), *sorted(lines.items())):
            label = self.line(line)
            if label == OTHER_LABEL:
                continue
            self.policy_version.labels("stable", label).set(table.stable)
            self.policy_version.labels("candidate", label).set(-1 if table.candidate is None else table.candidate)
            self.policy_version.labels("pinned", label).set(-1 if table.pinned is None else table.pinned)
            self.canary_share.labels(label).set(table.canary_share if table.candidate is not None else 0.0)

    def served(self, version: int, arm: str, line: str) -> None:
        """One served completion whose rollout record was stored."""
        self.recorded.labels(str(version), arm, self.line(line)).inc()


class ReloaderMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.reloads = Counter(
            "onlinerl_reloader_reloads_total", "Adapter/weight loads by result.", ["result"], registry=r
        )
        self.duration = Histogram(
            "onlinerl_reloader_reload_duration_seconds",
            "Verify + load + warm-up time.",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=r,
        )
        self.loaded = Gauge("onlinerl_reloader_loaded_versions", "Versions loaded in vLLM.", registry=r)
        self.refused = Counter(
            "onlinerl_reloader_refused_announcements_total",
            "Checkpoint announcements or folders refused (path outside the version folder, manifest, checksums).",
            ["reason"],
            registry=r,
        )
        self.failed = Counter(
            "onlinerl_reloader_failed_versions_total", "Versions given up after maxLoadFailures.", registry=r
        )
        self.last_reload = Gauge(
            "onlinerl_reloader_last_reload_timestamp_seconds", "Time of the last good load.", registry=r
        )
        self.serving_version = Gauge(
            "onlinerl_reloader_serving_version", "Newest version loaded and warmed.", registry=r
        )
