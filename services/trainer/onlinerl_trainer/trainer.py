"""The leader's trainer: the loop that reads a batch, computes advantages, updates, maybe publishes, acknowledges.

It composes three parts with one job each: ``SampleFeed`` (feed.py: stream, admission, dedupe, advantages),
``Learner`` (learner.py: model, optimizer, PPO update; the part every rank runs) and ``Publisher`` (publisher.py:
checkpoint, manifest, announce, prune, acknowledge), all behind the trainer ``Lease`` (fence.py).

Delivery invariant (docs/architecture.md): a sample leaves the stream only after the checkpoint it was trained into
is durably on disk and announced; each manifest lists its sample ids, so after a crash the trainer resumes from the
latest version and acknowledges (without retraining) pending samples that version already contains. Samples trained
after it are simply trained again on top of it: at least once delivery, exactly once in the published weights.

The ids of every kept manifest stay in memory (``trained_ids``), so an entry delivered again at any time (a Redis
failover that lost the group's last-delivered id and our XDELs) is acknowledged without training, not only at start.
Resume loads the newest version whose files match its manifest's sha256s; newer corrupt ones are refused loudly
(ERROR log, ``onlinerl_trainer_corrupt_checkpoints_total``, ``corrupt_versions`` in the status hash), their numbers
are never reused, and their sample ids do not count as trained (their weights are not the ones resumed from).

A human's rollback (``onlinerl policy rollback``: the policy table's ``rollback_to``/``rollback_at``) is followed
before anything is trained again (``follow_rollback``): the weights go back to the target's (a fresh optimizer, as a
start from that version), what was trained since the last publish is trained again on them, and the next version's
manifest says so (``parent_version`` = the target, ``rebased_from`` = the version dropped, ``rollback_at`` = the
rollback, carried down the lineage so a restart does not rebase twice). Training from the rolled-back weights would
hand the next gate a version built on what the human refused.

Per-project adapters (issue 39, ``projects.adapters``): the model holds one LoRA adapter per policy line on one base
(adapters.py), and the loop is line-aware rather than forked: each batch is split by line (routing.py: a sample's
project is its tenant), each line's samples make their own update with that line's optimizer, and each line
(:class:`TrainLine`) has its own version counter, checkpoints, rollback following and publisher, all under the one
trainer lease. A project's line opens once its traffic reaches ``projects.minSamplesPerHour``, from the shared line's
stable version (v0: the seed's fresh LoRA, the shared adapter's own start).
"""

from __future__ import annotations

import logging
import random
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import redis
import torch

from onlinerl.config import ConfigError, OnlineRLConfig
from onlinerl.dataplane import policy
from onlinerl.dataplane import samples as sample_family
from onlinerl.dataplane import trainer as trainer_status
from onlinerl.keys import SHARED_LINE, Keys, tenant_problem
from onlinerl.lines import PROJECTS_DIR, checkpoint_root
from onlinerl.schemas import PolicyTable, TrainingSample
from onlinerl_trainer.adapters import lines_problem, trainer_config_for_lines
from onlinerl_trainer.batching import Batch, collate
from onlinerl_trainer.checkpoint import CheckpointStore
from onlinerl_trainer.engine import Engine
from onlinerl_trainer.feed import Admitted, Recovery, SampleFeed
from onlinerl_trainer.fence import FencedOut, Lease
from onlinerl_trainer.learner import Learner
from onlinerl_trainer.lineage import clean_start
from onlinerl_trainer.metrics import TrainerMetrics
from onlinerl_trainer.policy import all_finite
from onlinerl_trainer.publisher import Publisher
from onlinerl_trainer.ranks import Ranks
from onlinerl_trainer.routing import HourlyTraffic, opens_line, route, served_line, stream_id_seconds
from onlinerl_trainer.stream import DEFAULT_CONSUMER, Entry, SampleStream
from onlinerl_trainer.update import UpdateResult

log = logging.getLogger("onlinerl.trainer")

__all__ = ["FencedOut", "NonFiniteWeightsError", "Recovery", "TrainLine", "Trainer", "default_holder"]


class NonFiniteWeightsError(RuntimeError):
    """The weights went non-finite: nothing is published; restart resumes from the last good version."""


def default_holder() -> str:
    """The lease holder's name: the pod name (a restarted container in the same pod takes its lease over at once)."""
    return socket.gethostname()


@dataclass
class TrainLine:
    """One policy line as the trainer keeps it: where it publishes, where its version and step are, the manual
    rollback its weights follow. Its trained sample ids are the feed's ``ledgers[name]``; its adapter and optimizer
    the learner's ``adapters``."""

    name: str
    publisher: Publisher
    version: int = 0
    step: int = 0
    samples_trained: int = 0
    steps_since_publish: int = 0
    last_stats: dict[str, float] = field(default_factory=dict)
    rollback_at: float | None = None  # the manual rollback the current weights follow (manifest lineage)
    rebased_from: int | None = None  # set by a rebase, written into the next manifest, then cleared
    rebase_problem: str | None = None  # a rollback target that cannot be loaded: nothing is trained
    origin: int | None = None  # a project line: the shared stable version its adapter started from (this run)

    @property
    def store(self) -> CheckpointStore:
        return self.publisher.store

    @property
    def keys(self) -> Keys:
        return self.publisher.keys

    @property
    def label(self) -> str:
        """For log lines: "" on the shared line, else " of project <name>"."""
        return self.publisher.of_line


class SharedLineField:
    """A read-only attribute of the trainer that is the shared line's (``Trainer.version`` = its version, ...)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, trainer: Trainer | None, owner: type | None = None) -> Any:
        if trainer is None:
            return self
        return getattr(trainer.shared, self.name)


class Trainer:
    """The leader: holds the lease (taken before anything is read from disk), feeds, trains, publishes."""

    def __init__(
        self,
        cfg: OnlineRLConfig,
        client: redis.Redis,
        model_path: Path,
        *,
        consumer: str = DEFAULT_CONSUMER,
        claim_idle_ms: int = 60_000,
        metrics: TrainerMetrics | None = None,
        ranks: Ranks = Ranks(),
        lease: Lease | None = None,
    ) -> None:
        assert ranks.leader, "followers run a Learner only (learner.follow)"
        problem = lines_problem(cfg)
        if problem is not None:
            raise ConfigError(problem)
        self.cfg = cfg
        self.projects = cfg.projects
        self.lines_on = cfg.projects.adapters != "off"
        self._retention_checked_at = 0.0  # enforce_retention: the last check (unix s)
        self.tcfg = trainer_config_for_lines(cfg)
        self.algo = self.tcfg.algorithm
        self.keys = Keys(cfg.job)
        self.client = client
        self.model_path = Path(model_path)
        self.metrics = metrics or TrainerMetrics()
        if lease is None:  # in-process use: take it now (waits while another holder has it)
            lease = Lease(client, self.keys, default_holder())
            lease.acquire()
        self.lease = lease
        self.metrics.lease_held.set(1)
        self.stream = SampleStream(client, self.keys, lease, consumer, claim_idle_ms)
        shared = TrainLine(SHARED_LINE, self._publisher(SHARED_LINE))
        self.lines: dict[str, TrainLine] = {SHARED_LINE: shared}
        latest = shared.publisher.newest_good_version()
        if ranks.distributed:  # every rank resumes this version (see ranks.py)
            ranks.connect()
            ranks.broadcast(("resume", latest))
        self.learner = Learner(
            self.tcfg, self.model_path, ranks, shared.store.path(latest) if latest else None, lines=self.lines_on
        )
        self.feed = SampleFeed(
            self.stream, self.tcfg, self.metrics, self.learner.vocab_size, shared.publisher.kept_sample_ids(latest)
        )
        self.feed.router = self.lines_for
        # An unseen tenant starts at the reward of showing nothing, so its first rejects already push down.
        self.feed.baseline.prior = cfg.feedback.reward.empty
        self.traffic = HourlyTraffic()
        self._open_refused: dict[str, str] = {}  # project -> why its line could not open (logged once per reason)
        self._tables: dict[str, PolicyTable] = {}  # policy tables read for the update in progress
        self.last_updates: dict[str, dict[str, float]] = {}  # line -> statistics of its update in the last train_on
        self._tensorboard = self._open_tensorboard()
        if latest:
            self._resume(shared, latest)
        if self.lines_on:
            self._resume_project_lines()

    # --- the parts, by the names tests and tools use (the shared line's, where a line is meant) -----------------
    @property
    def shared(self) -> TrainLine:
        return self.lines[SHARED_LINE]

    # the shared line's state, read-only, by the names tests and tools use
    version = SharedLineField()
    step = SharedLineField()
    samples_trained = SharedLineField()
    steps_since_publish = SharedLineField()
    last_stats = SharedLineField()
    rollback_at = SharedLineField()
    rebased_from = SharedLineField()
    rebase_problem = SharedLineField()

    @property
    def publisher(self) -> Publisher:
        return self.shared.publisher

    @property
    def store(self) -> CheckpointStore:
        return self.shared.store

    @property
    def engine(self) -> Engine:
        return self.learner.engine

    @property
    def reference(self) -> torch.nn.Module | None:
        return self.learner.reference

    @property
    def pad_id(self) -> int:
        return self.learner.pad_id

    @property
    def corrupt_versions(self) -> list[int]:
        return self.publisher.corrupt_versions

    @property
    def pending_ack(self) -> list[str]:
        """Trained since the shared line's last published version: acknowledged with its next one."""
        return self.feed.open_ids

    @property
    def trained_ids(self) -> set[str]:
        return self.feed.trained_ids

    # --- start-up ---------------------------------------------------------------------------------------------------
    def _publisher(self, line: str) -> Publisher:
        return Publisher(
            self.cfg, self.client, self.lease, self.stream, self.metrics, self.model_path, line, self._settle
        )

    def _settle(self, ids: list[str]) -> int:
        return self.feed.settle(ids)

    def _resume(self, line: TrainLine, latest: int) -> None:
        """``line`` continues from its ``v{latest}`` (its weights are loaded already): step, lineage, optimizer."""
        line.version = latest
        self.metrics.published(latest, line.name)
        manifest = line.store.manifest(latest)
        line.step = manifest.step
        line.rollback_at = manifest.rollback_at
        state = line.store.state_for(latest)
        if state is None:
            log.warning(
                "v%d%s has no saved optimizer state: resuming its weights with a fresh optimizer", latest, line.label
            )
            return
        directory, meta = state
        with self.learner.on_line(line.name):
            # the RNG is the job's: a project line's state does not reseed it
            self.learner.resume(directory, meta if not line.name else {k: v for k, v in meta.items() if k != "rng"})
        line.step = int(meta.get("step", line.step))
        line.samples_trained = int(meta.get("samples_trained", 0))
        baseline = meta.get("baseline", {})
        if not line.name:
            self.feed.baseline.load_state_dict(baseline)
        elif line.name in baseline:  # a project's own tenant: its line saw its rewards last
            self.feed.baseline.means[line.name] = float(baseline[line.name])
        log.info("resumed%s from v%d at step %d", line.label, latest, line.step)

    def _resume_project_lines(self) -> None:
        """Every project that may have its own line and has a published version on disk gets its adapter back at
        once (an open line stays open: routing.py), from its newest good version."""
        root = checkpoint_root(self.cfg.storage.checkpoint_dir, self.cfg.job) / PROJECTS_DIR
        if not root.is_dir():
            return
        for folder in sorted(root.iterdir()):
            project = folder.name
            if not folder.is_dir() or tenant_problem(project) is not None:
                continue
            if not self.projects.has_own_line(project):
                log.info("project %s has checkpoints but no line of its own in projects: it trains shared", project)
                continue
            publisher = self._publisher(project)
            latest = publisher.newest_good_version()
            if latest:
                line = self._add_line(project, publisher, publisher.store.path(latest), latest)
                self._resume(line, latest)

    def _add_line(self, project: str, publisher: Publisher, weights_from: Path | None, kept_from: int) -> TrainLine:
        self.learner.adapters.add(project, weights_from)
        self.feed.add_line(project, publisher.kept_sample_ids(kept_from) if kept_from else {})
        line = self.lines[project] = TrainLine(project, publisher)
        self.traffic.forget(project)
        self.metrics.lines.set(len(self.lines))
        self.metrics.published(line.version, project)
        return line

    def open_line(self, project: str) -> bool:
        """Give ``project`` its own adapter now: from its own newest version when its line has one on disk, else
        from the shared line's stable version (v0: the seed's fresh LoRA, what the shared adapter started from).
        False when the shared stable version cannot be loaded (its files fail their sha256): the project stays on
        the shared line, ERROR in the log, and the next sample tries again."""
        publisher = self._publisher(project)
        own = publisher.newest_good_version()
        if own:
            line = self._add_line(project, publisher, publisher.store.path(own), own)
            self._resume(line, own)
            return True
        stable, why = clean_start(
            self._table(SHARED_LINE).stable, self.shared.store.manifest, project, self.projects.has_own_line
        )
        if why:
            log.warning("project %s: %s (lineage.py: no other project's code in its adapter)", project, why)
        problems = self.shared.store.problems(stable) if stable else []
        if problems:
            why = f"shared stable v{stable} cannot be loaded: {'; '.join(problems)}"
            if self._open_refused.get(project) != why:
                log.error("project %s stays on the shared policy: %s", project, why)
                self._open_refused[project] = why
            return False
        line = self._add_line(project, publisher, self.shared.store.path(stable) if stable else None, 0)
        line.origin = stable
        self._open_refused.pop(project, None)
        log.info("project %s has its own adapter from now on, starting from shared stable v%d", project, stable)
        return True

    def start(self) -> Recovery:
        """Re-announce a version a crash left unannounced (on every line), then recover pending entries."""
        for line in self.lines.values():
            line.publisher.reannounce(line.version)
        rec = self.feed.recover()
        corrupt = ",".join(str(v) for v in sorted(self.corrupt_versions))
        trainer_status.write_status(self.client, self.keys, {"corrupt_versions": corrupt})
        self._status("waiting")
        for line in self.lines.values():
            self.metrics.published(line.version, line.name)
        return rec

    # --- routing: which lines a sample trains ------------------------------------------------------------------------
    def lines_for(self, sample_id: str, sample: TrainingSample) -> tuple[str, ...]:
        """The feed's router: a project's traffic opens its line (routing.opens_line), then routing.route decides by
        the tenant; a sample claiming another project's line is counted and logged, and trains its tenant's lines."""
        project = sample.tenant
        own_line_possible = self.lines_on and project not in self.lines and tenant_problem(project) is None
        if own_line_possible and self.projects.has_own_line(project):
            count = self.traffic.add(project, sample_id, stream_id_seconds(sample_id), time.time())
            if opens_line(self.projects, project, count):
                self.open_line(project)
        decided = route(project, sample.line, self.lines, self.projects.train_shared)
        if decided.claimed_other:
            self.metrics.line_mismatch.inc()
            log.warning(
                "sample %s of project %s says project %r's line served it: it trains %s only (the tenant decides)",
                sample_id,
                project,
                sample.line,
                " and ".join(repr(x) if x else "the shared line" for x in decided.lines),
            )
        return decided.lines

    def _position(self, sample: TrainingSample) -> tuple[int, int | None]:
        """Version and oldest served version of the line that served ``sample`` (its staleness is counted there)."""
        line = served_line(sample.tenant, sample.line, self.lines)
        return self.lines[line].version, self.oldest_served(self._table(line))

    def _table(self, line: str) -> PolicyTable:
        """A line's policy table, read once per update."""
        if line not in self._tables:
            self._tables[line] = policy.read(
                self.client, self.lines[line].keys if line in self.lines else self.keys.for_project(line)
            )
        return self._tables[line]

    # --- the loop ---------------------------------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        """Read a batch -> advantages -> update per line -> maybe publish (which acknowledges), until ``stop``; then
        publish what was trained (no new update starts once ``stop`` is set).

        A Redis error drops the batch being read from memory (it is still pending at our consumer) and retries with
        backoff; losing the lease raises ``FencedOut`` at once: another trainer is publishing now.
        """
        backoff, lost_entries = 0.5, False
        while not stop.is_set():
            if self.lease.lost.is_set():
                raise FencedOut("the trainer lease was taken over or expired: stopping without publishing")
            self.learner.keep_followers_alive()
            try:
                if lost_entries:
                    self.feed.requeue_own_pending(self._unannounced_ids())
                    lost_entries = False
                for line in list(self.lines.values()):
                    if line.publisher.unannounced:
                        self._finish_publish(line.name)
                if self.tcfg.suspend:
                    self._status("suspended")
                    stop.wait(1.0)
                    continue
                entries = self.collect(stop)
                if entries and stop.is_set():
                    # No update is started once a stop was asked for: a SIGTERM (a rolling update, a drain, Ctrl-C)
                    # is answered in the time of a publish, not of a step (9 s on SmolLM2 on a busy 2-core box, more
                    # on a large model on CPU), within the pod's grace period. The entries stay pending at this
                    # consumer, as after a crash, and the next trainer's recovery claims and trains them.
                    log.info("stop requested: %d collected samples left pending for the next start", len(entries))
                elif entries:
                    self.train_on(entries)
                if any(line.rebase_problem is not None for line in self.lines.values()):
                    stop.wait(1.0)  # a rollback's target cannot be loaded: wait for a human, untrained
                    continue
                for name in self.due_lines():
                    self.publish(name)
                self.enforce_retention()
                backoff = 0.5
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                log.warning("redis unavailable (%s): retrying in %.1fs", exc, backoff)
                lost_entries = True
                stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)
        self.publish()  # graceful stop: what was trained is published on every line, then acknowledged
        self.learner.stop_followers()
        self._status("stopped")

    def enforce_retention(self, now: float | None = None, every: float = 60.0) -> int:
        """Delete samples no trainer acknowledged within ``privacy.retention.pendingSamplesSeconds`` (at most once a
        minute): the trainer owns the samples stream, so it enforces its retention. Returns how many went."""
        now = time.time() if now is None else now
        if now - self._retention_checked_at < every:
            return 0
        self._retention_checked_at = now
        keep = self.cfg.privacy.retention.pending_samples_seconds
        deleted = sample_family.trim_expired(self.client, self.keys, int((now - keep) * 1000))
        if deleted:
            log.warning(
                "%d samples older than privacy.retention.pendingSamplesSeconds=%d deleted untrained", deleted, keep
            )
        return deleted

    def collect(self, stop: threading.Event | None = None, poll_ms: int = 500) -> list[Entry]:
        """Up to ``batchSize`` entries (see SampleFeed.collect); returns early when a publish is due."""
        return self.feed.collect(stop, poll_ms, close_early=self.should_publish)

    def oldest_served(self, table: PolicyTable | None = None) -> int:
        """The oldest version serving gives users now: the policy table's stable, or an older pinned or candidate
        version (staleness is counted against it, so a trainer that outruns the rollout keeps learning from every
        version users are served)."""
        table = table or policy.read(self.client, self.keys)
        served = [table.stable, *(v for v in (table.candidate, table.pinned) if v is not None)]
        return min(served)

    def train_on(self, entries: list[Entry]) -> dict[str, float] | None:
        """One PPO update per policy line on these entries (each line's samples alone). Returns the statistics of
        the shared line's update (else of the one line trained; all of them: ``last_updates``), or None when
        nothing was trainable or every update was skipped."""
        self._tables, self.last_updates = {}, {}
        try:
            return self._train_lines(entries)
        finally:
            self._tables = {}  # read again by the next update (and by a line opened between updates)

    def _train_lines(self, entries: list[Entry]) -> dict[str, float] | None:
        for line in list(self.lines.values()):
            if not self.follow_rollback(self._table(line.name), line.name):
                self.feed.replay.extendleft(reversed(entries))  # untrained, unacknowledged: trained once it can rebase
                return None
        admitted = self.feed.admit_lines(entries, self._position)
        discarded: list[str] = []
        for name in sorted(admitted):  # the shared line first, then the projects by name
            stats = self._train_line(self.lines[name], admitted[name], discarded)
            if stats is not None:
                self.last_updates[name] = stats
        self.feed.settle(discarded)  # after every line trained: a sample another line holds open stays pending
        self._status("waiting")
        if SHARED_LINE in self.last_updates:
            return self.last_updates[SHARED_LINE]
        return next(iter(self.last_updates.values()), None)

    def _train_line(self, line: TrainLine, admitted: Admitted, discarded: list[str]) -> dict[str, float] | None:
        """One PPO update of ``line``'s adapter on its admitted samples; a skipped step's ids go to ``discarded``."""
        samples, adv = admitted.samples, admitted.advantages
        self._status("training")
        batch = collate(samples, self.tcfg.max_seq_len, self.pad_id)
        self.learner.send_update(samples, adv)
        t0 = time.perf_counter()
        adv_t = torch.tensor(adv, dtype=torch.float32)
        with self.learner.on_line(line.name):
            result = self._update(batch, adv_t)
        elapsed = time.perf_counter() - t0
        ids = [s.sample_id for s in samples]
        if result.skipped_reason is not None:
            log.error("step skipped%s (%s): discarding %d samples", line.label, result.skipped_reason, len(ids))
            self.metrics.skipped.labels(result.skipped_reason).inc()
            discarded.extend(ids)  # deliberately discarded: retrying a non-finite batch would loop forever
            return None
        line.step += 1
        line.steps_since_publish += 1
        line.samples_trained += len(ids)
        self.feed.trained(ids, ((s.sample.tenant, s.sample.user_hash) for s in samples), line.name)
        rewards = [s.sample.reward for s in samples]
        stats = {
            **result.stats,
            "grad_norm": result.grad_norm,
            "reward_mean": sum(rewards) / len(rewards),
            "advantage_mean": float(adv_t.mean()),
            "advantage_std": float(adv_t.std(unbiased=False)),
            "step_seconds": elapsed,
            "samples": float(len(ids)),
        }
        line.last_stats = stats
        self._record(stats, batch.num_tokens, elapsed, line)
        return stats

    # --- manual rollbacks -------------------------------------------------------------------------------------------
    def follow_rollback(self, table: PolicyTable, line_name: str = SHARED_LINE) -> bool:
        """Rebase ``line_name``'s adapter onto its last manual rollback's target if its weights do not follow it yet.
        False while the target cannot be loaded (nothing may be trained meanwhile: the status hash's ``rebase`` says
        why). A project line's v0 is a fresh start from the shared line's stable version, as when it opened."""
        line = self.lines[line_name]
        if table.rollback_to is None or table.rollback_at == line.rollback_at:
            return True
        suffix = f"@{line.name}" if line.name else ""
        target, dropped = table.rollback_to, line.version
        if target != dropped:
            source, problems = line.store.path(target), line.store.problems(target) if target else []
            if not target:
                stable = self._table(SHARED_LINE).stable if line.name else 0
                source = self.shared.store.path(stable) if stable else None
                problems = self.shared.store.problems(stable) if stable else []
            if problems:
                why = (
                    f"cannot rebase{line.label} onto v{target} (the rollback's target): {'; '.join(problems)}; "
                    "not training"
                )
                if why != line.rebase_problem:
                    log.error("%s", why)
                    trainer_status.write_status(self.client, self.keys, {f"rebase{suffix}": why})
                line.rebase_problem = why
                return False
            with self.learner.on_line(line.name):
                self.learner.rebase(source)
            again = self.feed.rebased(line.publisher.kept_sample_ids(target), line.name)
            line.version, line.rebased_from, line.steps_since_publish = target, dropped, 0
            log.warning(
                "manual rollback%s to v%d: training from v%d's weights (v%d's dropped; %d entries trained since the "
                "last publish are trained again)",
                line.label,
                target,
                target,
                dropped,
                again,
            )
        line.rollback_at, line.rebase_problem = table.rollback_at, None
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(table.rollback_at))
        note = f"on v{target} since the rollback at {when}"
        note += f" (v{dropped}'s weights dropped)" if target != dropped else ""
        trainer_status.write_status(
            self.client, self.keys, {f"rebase{suffix}": note, f"version{suffix}": str(line.version)}
        )
        self.metrics.published(line.version, line.name)
        return True

    def _update(self, batch: Batch, advantages: torch.Tensor) -> UpdateResult:
        """One PPO update of the line the learner is on (``Learner.on_line``)."""
        return self.learner.update_batch(batch, advantages)

    def _record(self, stats: dict[str, float], tokens: int, elapsed: float, line: TrainLine) -> None:
        m = self.metrics
        m.record_stats(stats, line.name)  # and the line's step
        m.samples.inc(stats["samples"])
        m.tokens.inc(tokens)
        m.step_seconds.observe(elapsed)
        m.samples_per_second.set(stats["samples"] / max(elapsed, 1e-9))
        m.tokens_per_second.set(tokens / max(elapsed, 1e-9))
        if self._tensorboard is not None:
            prefix = f"trainer@{line.name}" if line.name else "trainer"
            for k, v in stats.items():
                self._tensorboard.add_scalar(f"{prefix}/{k}", v, line.step)

    # --- publishing -------------------------------------------------------------------------------------------------
    def due_lines(self) -> list[str]:
        """Lines whose publish is due (``checkpoint.everySteps`` steps or ``everySeconds`` of their own)."""
        return [
            name
            for name, line in self.lines.items()
            if line.publisher.due(len(self.feed.ledgers[name].open_ids), line.steps_since_publish)
        ]

    def should_publish(self) -> bool:
        return bool(self.due_lines())

    def publish(self, line: str | None = None) -> int | None:
        """Write ``line``'s v{N+1} (weights + manifest), save its resume state, announce, then acknowledge what no
        other line still holds. ``line`` None: every line with something to publish. Returns the version published
        on ``line`` (None: the shared line's), or None when there was nothing to publish."""
        names = [line] if line is not None else list(self.lines)
        published: dict[str, int | None] = {}
        for name in names:
            published[name] = self._publish_line(self.lines[name])
        return published.get(SHARED_LINE if line is None else line)

    def _publish_line(self, line: TrainLine) -> int | None:
        if line.publisher.unannounced:
            self._finish_publish(line.name)
        if not self.feed.ledgers[line.name].open_ids:
            return None
        version = self.write_version(line.name)
        self._finish_publish(line.name)
        return version

    def write_version(self, line_name: str = SHARED_LINE) -> int:
        """The durable half of publishing: the line's v{N+1} on disk and its resume state. Nothing is announced or
        acked yet."""
        line = self.lines[line_name]
        self._status("publishing")
        with self.learner.on_line(line.name):
            weights = self.learner.trainable_weights()
            if not all_finite(weights):
                self.metrics.skipped.labels("nonfinite_weights").inc()
                self._status("failed")
                raise NonFiniteWeightsError(
                    f"non-finite weights after step {line.step}{line.label}: v{line.version + 1} not published"
                )
            origin = {} if line.origin is None else {"origin_shared_version": float(line.origin)}
            version = line.publisher.write(
                parent=line.version,
                step=line.step,
                ids=list(self.feed.ledgers[line.name].open_ids),
                stats={**line.last_stats, "samples_trained_total": float(line.samples_trained), **origin},
                weights=weights,
                module=self.engine.module,
                save_state=self.learner.save_state,
                meta={
                    "step": line.step,
                    "samples_trained": line.samples_trained,
                    "baseline": self.feed.baseline.state_dict(),
                    "rng": random.randrange(2**31),
                },
                rebased_from=line.rebased_from,
                rollback_at=line.rollback_at,
                contributors=self.feed.take_contributors(line.name),
            )
        line.rebased_from = None
        line.version = version
        self.feed.sealed(version, line.name)
        line.steps_since_publish = 0
        return version

    def _finish_publish(self, line_name: str = SHARED_LINE) -> None:
        """Announce the line's written version, acknowledge its samples, prune old versions (retried if Redis
        fails)."""
        _, _, pruned = self.lines[line_name].publisher.finish()
        self.feed.forget(pruned, line_name)
        self._status("waiting")

    def _unannounced_ids(self) -> set[str]:
        return {
            sid for line in self.lines.values() if line.publisher.unannounced for sid in line.publisher.unannounced[1]
        }

    # --- status -----------------------------------------------------------------------------------------------------
    def _status(self, state: str) -> None:
        """The job's trainer status hash: written by the lease holder only (a fenced-out trainer stays quiet)."""
        if self.lease.lost.is_set():
            return
        trainer_status.write_status(
            self.client,
            self.keys,
            {
                "step": str(self.step),
                "version": str(self.version),
                "samples_trained": str(self.samples_trained),
                "state": state,
                "engine": self.engine.name,
                "updated_at": repr(time.time()),
                # project lines (issue 39): project -> its version
                **(
                    {"projects": orjson.dumps({n: x.version for n, x in self.lines.items() if n}).decode()}
                    if self.lines_on
                    else {}
                ),
            },
        )

    def _open_tensorboard(self):
        if not self.tcfg.tensorboard_dir:
            return None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            log.warning("trainer.tensorboardDir is set but tensorboard is not installed: TensorBoard logs are off")
            return None
        return SummaryWriter(self.tcfg.tensorboard_dir)

    def close(self) -> None:
        """Close TensorBoard and give the lease up, so a waiting trainer takes over at once."""
        if self._tensorboard is not None:
            self._tensorboard.close()
        self.lease.release()
