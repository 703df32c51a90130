"""Prometheus metrics of the gateway and the reloader. Names and labels are a contract (docs/architecture.md)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Sub-millisecond buckets: the gateway's own overhead is the figure we promise (<= 2 ms at p50).
_OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1)
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
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
            "onlinerl_serving_rollouts_recorded_total", "Rollout records stored.", ["version", "arm"], registry=r
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
        self.policy_version = Gauge(
            "onlinerl_serving_policy_version", "Versions in the cached policy table.", ["role"], registry=r
        )


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
