"""The trainer's Prometheus metrics (names are a contract: docs/architecture.md) and its /metrics + /healthz server.

A private registry, so several trainers in one test process do not collide.

Per policy line (issue 39): the last update's statistics (loss, KL, clip fraction, ...), the optimizer steps and the
published version carry a ``line`` label (``onlinerl.metric_lines``: ``shared`` or the project; a line exists only
for a project with an adapter of its own, and the label names at most ``MAX_NAMED_LINES`` of them per process, later
ones counting their steps under ``other``). The shared line's series exist from the start.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from onlinerl.httpserve import Health, MetricsHTTPServer, always_healthy
from onlinerl.keys import SHARED_LINE
from onlinerl.metric_lines import OTHER_LABEL, SHARED_LABEL, LineLabels

# gauge name suffix -> key in the update statistics
STAT_GAUGES = {
    "loss": "loss",
    "clip_fraction": "clip_fraction",
    "approx_kl": "approx_kl",
    "ratio_mean": "ratio_mean",
    "ratio_max": "ratio_max",
    "reward_mean": "reward_mean",
    "advantage_mean": "advantage_mean",
    "advantage_std": "advantage_std",
    "entropy": "entropy",
    "entropy_running": "entropy_running",
    "grad_norm": "grad_norm",
    "kl_to_base": "kl",
    "negative_advantage_share": "negative_advantage_share",
    "entropy_out_of_band": "entropy_out_of_band",
}

# label values (a contract: docs/architecture.md); validation.py decides which one applies
INVALID_REASONS = (
    "undecodable",
    "empty",
    "length_mismatch",
    "out_of_vocab",
    "bad_logprob",
    "bad_reward",
    "bad_temperature",
)
DROP_REASONS = ("too_long", "already_trained")


class TrainerMetrics:
    def __init__(self, line_labels: LineLabels | None = None) -> None:
        self.registry = CollectorRegistry()
        self.line = line_labels or LineLabels()  # line -> its `line` label value, capped
        r = self.registry
        self.gauges = {
            k: Gauge(f"onlinerl_trainer_{k}", f"the line's last update's {k.replace('_', ' ')}", ["line"], registry=r)
            for k in STAT_GAUGES
        }
        self.samples = Counter("onlinerl_trainer_samples", "samples trained", registry=r)
        self.tokens = Counter("onlinerl_trainer_tokens", "completion tokens trained", registry=r)
        self.steps = Counter("onlinerl_trainer_steps", "optimizer steps taken, per policy line", ["line"], registry=r)
        self.skipped = Counter("onlinerl_trainer_skipped_steps", "steps skipped by a guard", ["reason"], registry=r)
        self.stale = Counter(
            "onlinerl_trainer_stale_samples", "samples over the staleness limit", ["action"], registry=r
        )
        self.inert = Counter(
            "onlinerl_trainer_inert_samples",
            "samples acknowledged without a pass: zero advantage and no KL/entropy term (no gradient)",
            registry=r,
        )
        self.subsampled = Counter(
            "onlinerl_trainer_subsampled_samples",
            "negative-advantage samples acknowledged untrained by trainer.algorithm.negativeSampleRate (the kept ones "
            "carry their weight: an unbiased gradient)",
            registry=r,
        )
        self.invalid = Counter(
            "onlinerl_trainer_invalid_samples",
            "stream entries that are not a valid sample (acknowledged, never trained)",
            ["reason"],
            registry=r,
        )
        self.dropped = Counter(
            "onlinerl_trainer_dropped_samples",
            "valid samples acknowledged without training: too_long (prompt + completion over trainer.maxSeqLen, "
            "never cut) or already_trained (re-delivered id already in a kept manifest or in the open version)",
            ["reason"],
            registry=r,
        )
        self.corrupt_checkpoints = Counter(
            "onlinerl_trainer_corrupt_checkpoints",
            "versions refused at resume because a file differs from the manifest's sha256",
            registry=r,
        )
        self.step_seconds = Histogram(
            "onlinerl_trainer_step_duration_seconds",
            "wall time of one PPO update",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
            registry=r,
        )
        self.staleness = Histogram(
            "onlinerl_trainer_sample_staleness_versions",
            "policy versions behind at training",
            buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16, 32),
            registry=r,
        )
        self.version = Gauge(
            "onlinerl_trainer_policy_version", "latest published policy version of each line", ["line"], registry=r
        )
        self.last_checkpoint = Gauge(
            "onlinerl_trainer_last_checkpoint_timestamp_seconds",
            "unix time of the last published checkpoint",
            registry=r,
        )
        self.samples_per_second = Gauge(
            "onlinerl_trainer_samples_per_second", "last step's samples / step time", registry=r
        )
        self.tokens_per_second = Gauge(
            "onlinerl_trainer_tokens_per_second", "last step's tokens / step time", registry=r
        )
        self.lease_held = Gauge(
            "onlinerl_trainer_lease_held",
            "1 while this process holds the trainer lease (may publish), 0 while it waits for it",
            registry=r,
        )
        # per-project adapters (issue 39; services/trainer/README.md)
        self.lines = Gauge(
            "onlinerl_trainer_policy_lines",
            "policy lines with an adapter in this trainer, the shared one included",
            registry=r,
        )
        self.lines.set(1)
        self.line_mismatch = Counter(
            "onlinerl_trainer_line_mismatch_samples",
            "samples whose line names another project's adapter: trained on their tenant's lines only",
            registry=r,
        )
        self.steps.labels(SHARED_LABEL)
        self.version.labels(SHARED_LABEL)
        for gauge in self.gauges.values():
            gauge.labels(SHARED_LABEL)
        for reason in ("nonfinite_loss", "nonfinite_grad", "nonfinite_weights"):
            self.skipped.labels(reason)
        for action in ("dropped", "downweighted"):
            self.stale.labels(action)
        for reason in INVALID_REASONS:
            self.invalid.labels(reason)
        for reason in DROP_REASONS:
            self.dropped.labels(reason)

    def record_stats(self, stats: dict[str, float], line: str = SHARED_LINE) -> None:
        """``line``'s last update: its statistics (not exported for a line over the label cap: a loss of "some
        other line" means nothing) and one step."""
        label = self.line(line)
        self.steps.labels(label).inc()
        if label == OTHER_LABEL:
            return
        for name, key in STAT_GAUGES.items():
            if key in stats:
                self.gauges[name].labels(label).set(stats[key])

    def published(self, version: int, line: str = SHARED_LINE) -> None:
        """``line`` is on ``version`` now (published, resumed or rebased by a rollback)."""
        label = self.line(line)
        if label != OTHER_LABEL:
            self.version.labels(label).set(version)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class MetricsServer(MetricsHTTPServer):
    """``/metrics`` and ``/healthz`` of the trainer (the shared stdlib server: the trainer has no web framework)."""

    def __init__(self, metrics: TrainerMetrics, host: str, port: int, health: Health = always_healthy) -> None:
        super().__init__(metrics.render, host, port, health=health, name="trainer-metrics")
