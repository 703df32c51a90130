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
"""

from __future__ import annotations

import logging
import random
import socket
import threading
import time
from pathlib import Path

import redis
import torch

from onlinerl.config import OnlineRLConfig
from onlinerl.dataplane import policy
from onlinerl.dataplane import samples as sample_family
from onlinerl.dataplane import trainer as trainer_status
from onlinerl.keys import Keys
from onlinerl.schemas import PolicyTable
from onlinerl_trainer.batching import Batch, collate
from onlinerl_trainer.checkpoint import CheckpointStore
from onlinerl_trainer.engine import Engine
from onlinerl_trainer.feed import Recovery, SampleFeed
from onlinerl_trainer.fence import FencedOut, Lease
from onlinerl_trainer.learner import Learner
from onlinerl_trainer.metrics import TrainerMetrics
from onlinerl_trainer.policy import all_finite
from onlinerl_trainer.publisher import Publisher
from onlinerl_trainer.ranks import Ranks
from onlinerl_trainer.stream import DEFAULT_CONSUMER, Entry, SampleStream
from onlinerl_trainer.update import UpdateResult

log = logging.getLogger("onlinerl.trainer")

__all__ = ["FencedOut", "NonFiniteWeightsError", "Recovery", "Trainer", "default_holder"]


class NonFiniteWeightsError(RuntimeError):
    """The weights went non-finite: nothing is published; restart resumes from the last good version."""


def default_holder() -> str:
    """The lease holder's name: the pod name (a restarted container in the same pod takes its lease over at once)."""
    return socket.gethostname()


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
        self.cfg = cfg
        self._retention_checked_at = 0.0  # enforce_retention: the last check (unix s)
        self.tcfg = cfg.trainer
        self.algo = cfg.trainer.algorithm
        self.keys = Keys(cfg.job)
        self.client = client
        self.model_path = Path(model_path)
        self.metrics = metrics or TrainerMetrics()
        if lease is None:  # in-process use: take it now (waits while another holder has it)
            lease = Lease(client, self.keys, default_holder())
            lease.acquire()
        self.lease = lease
        self.metrics.lease_held.set(1)
        stream = SampleStream(client, self.keys, lease, consumer, claim_idle_ms)
        self.publisher = Publisher(cfg, client, lease, stream, self.metrics, self.model_path)
        latest = self.publisher.newest_good_version()
        if ranks.distributed:  # every rank resumes this version (see ranks.py)
            ranks.connect()
            ranks.broadcast(("resume", latest))
        self.learner = Learner(self.tcfg, self.model_path, ranks, self.store.path(latest) if latest else None)
        self.feed = SampleFeed(
            stream, self.tcfg, self.metrics, self.learner.vocab_size, self.publisher.kept_sample_ids(latest)
        )
        # An unseen tenant starts at the reward of showing nothing, so its first rejects already push down.
        self.feed.baseline.prior = cfg.feedback.reward.empty
        self.version = 0
        self.step = 0
        self.samples_trained = 0
        self.steps_since_publish = 0
        self.last_stats: dict[str, float] = {}
        self.rollback_at: float | None = None  # the manual rollback the current weights follow (manifest lineage)
        self.rebased_from: int | None = None  # set by a rebase, written into the next manifest, then cleared
        self.rebase_problem: str | None = None  # a rollback target that cannot be loaded: nothing is trained
        self._tensorboard = self._open_tensorboard()
        if latest:
            self._resume(latest)

    # --- the parts, by the names tests and tools use ----------------------------------------------------------------
    @property
    def store(self) -> CheckpointStore:
        return self.publisher.store

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
        """Trained since the last published version: acknowledged with the next one."""
        return self.feed.open_ids

    @property
    def trained_ids(self) -> set[str]:
        return self.feed.trained_ids

    # --- start-up ---------------------------------------------------------------------------------------------------
    def _resume(self, latest: int) -> None:
        self.version = latest
        manifest = self.store.manifest(latest)
        self.step = manifest.step
        self.rollback_at = manifest.rollback_at
        state = self.store.state_for(latest)
        if state is None:
            log.warning("v%d has no saved optimizer state: resuming its weights with a fresh optimizer", latest)
            return
        directory, meta = state
        self.learner.resume(directory, meta)
        self.step = int(meta.get("step", self.step))
        self.samples_trained = int(meta.get("samples_trained", 0))
        self.feed.baseline.load_state_dict(meta.get("baseline", {}))
        log.info("resumed from v%d at step %d", latest, self.step)

    def start(self) -> Recovery:
        """Re-announce a version a crash left unannounced, then recover pending entries."""
        self.publisher.reannounce(self.version)
        rec = self.feed.recover()
        corrupt = ",".join(str(v) for v in sorted(self.corrupt_versions))
        trainer_status.write_status(self.client, self.keys, {"corrupt_versions": corrupt})
        self._status("waiting")
        self.metrics.version.set(self.version)
        return rec

    # --- the loop ---------------------------------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        """Read a batch -> advantages -> update -> maybe publish (which acknowledges), until ``stop``.

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
                if self.publisher.unannounced:
                    self._finish_publish()
                if self.tcfg.suspend:
                    self._status("suspended")
                    stop.wait(1.0)
                    continue
                entries = self.collect(stop)
                if entries:
                    self.train_on(entries)
                if self.rebase_problem is not None:
                    stop.wait(1.0)  # the rollback's target cannot be loaded: wait for a human, untrained
                    continue
                if self.should_publish():
                    self.publish()
                self.enforce_retention()
                backoff = 0.5
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                log.warning("redis unavailable (%s): retrying in %.1fs", exc, backoff)
                lost_entries = True
                stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)
        if self.pending_ack or self.publisher.unannounced:
            self.publish()  # graceful stop: what was trained is published, then acknowledged
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
        """One PPO update on these entries. Returns its statistics, or None when nothing was trainable/skipped."""
        table = policy.read(self.client, self.keys)
        if not self.follow_rollback(table):
            self.feed.replay.extendleft(reversed(entries))  # untrained, unacknowledged: trained once it can rebase
            return None
        admitted = self.feed.admit(entries, self.version, self.oldest_served(table))
        samples, adv = admitted.samples, admitted.advantages
        if not samples:
            return None
        self._status("training")
        batch = collate(samples, self.tcfg.max_seq_len, self.pad_id)
        self.learner.send_update(samples, adv)
        t0 = time.perf_counter()
        adv_t = torch.tensor(adv, dtype=torch.float32)
        result = self._update(batch, adv_t)
        elapsed = time.perf_counter() - t0
        ids = [s.sample_id for s in samples]
        if result.skipped_reason is not None:
            log.error("step skipped (%s): discarding %d samples", result.skipped_reason, len(ids))
            self.metrics.skipped.labels(result.skipped_reason).inc()
            self.feed.stream.ack(ids)  # deliberately discarded: retrying a non-finite batch would loop forever
            self._status("waiting")
            return None
        self.step += 1
        self.steps_since_publish += 1
        self.samples_trained += len(ids)
        self.feed.trained(ids, ((s.sample.tenant, s.sample.user_hash) for s in samples))
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
        self._record(stats, batch.num_tokens, elapsed)
        self._status("waiting")
        return stats

    # --- manual rollbacks -------------------------------------------------------------------------------------------
    def follow_rollback(self, table: PolicyTable) -> bool:
        """Rebase onto the last manual rollback's target if these weights do not follow it yet. False while the
        target cannot be loaded (nothing may be trained meanwhile: the status hash's ``rebase`` says why)."""
        if table.rollback_to is None or table.rollback_at == self.rollback_at:
            return True
        target, dropped = table.rollback_to, self.version
        if target != dropped:
            problems = self.store.problems(target) if target else []
            if problems:
                why = f"cannot rebase onto v{target} (the rollback's target): {'; '.join(problems)}; not training"
                if why != self.rebase_problem:
                    log.error("%s", why)
                    trainer_status.write_status(self.client, self.keys, {"rebase": why})
                self.rebase_problem = why
                return False
            self.learner.rebase(self.store.path(target) if target else None)
            again = self.feed.rebased(self.publisher.kept_sample_ids(target))
            self.version, self.rebased_from, self.steps_since_publish = target, dropped, 0
            log.warning(
                "manual rollback to v%d: training from v%d's weights (v%d's dropped; %d entries trained since the "
                "last publish are trained again)",
                target,
                target,
                dropped,
                again,
            )
        self.rollback_at, self.rebase_problem = table.rollback_at, None
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(table.rollback_at))
        note = f"on v{target} since the rollback at {when}"
        note += f" (v{dropped}'s weights dropped)" if target != dropped else ""
        trainer_status.write_status(self.client, self.keys, {"rebase": note, "version": str(self.version)})
        self.metrics.version.set(self.version)
        return True

    def _update(self, batch: Batch, advantages: torch.Tensor) -> UpdateResult:
        return self.learner.update_batch(batch, advantages)

    def _record(self, stats: dict[str, float], tokens: int, elapsed: float) -> None:
        self.last_stats = stats
        m = self.metrics
        m.record_stats(stats)
        m.samples.inc(stats["samples"])
        m.tokens.inc(tokens)
        m.steps.inc()
        m.step_seconds.observe(elapsed)
        m.samples_per_second.set(stats["samples"] / max(elapsed, 1e-9))
        m.tokens_per_second.set(tokens / max(elapsed, 1e-9))
        if self._tensorboard is not None:
            for k, v in stats.items():
                self._tensorboard.add_scalar(f"trainer/{k}", v, self.step)

    # --- publishing -------------------------------------------------------------------------------------------------
    def should_publish(self) -> bool:
        return self.publisher.due(len(self.pending_ack), self.steps_since_publish)

    def publish(self) -> int | None:
        """Write v{N+1} (weights + manifest), save the resume state, announce, then acknowledge its samples."""
        if self.publisher.unannounced:
            self._finish_publish()
        if not self.pending_ack:
            return None
        version = self.write_version()
        self._finish_publish()
        return version

    def write_version(self) -> int:
        """The durable half of publishing: v{N+1} on disk and its resume state. Nothing is announced or acked yet."""
        self._status("publishing")
        weights = self.learner.trainable_weights()
        if not all_finite(weights):
            self.metrics.skipped.labels("nonfinite_weights").inc()
            self._status("failed")
            raise NonFiniteWeightsError(f"non-finite weights after step {self.step}: v{self.version + 1} not published")
        version = self.publisher.write(
            parent=self.version,
            step=self.step,
            ids=list(self.pending_ack),
            stats={**self.last_stats, "samples_trained_total": float(self.samples_trained)},
            weights=weights,
            module=self.engine.module,
            save_state=self.learner.save_state,
            meta={
                "step": self.step,
                "samples_trained": self.samples_trained,
                "baseline": self.feed.baseline.state_dict(),
                "rng": random.randrange(2**31),
            },
            rebased_from=self.rebased_from,
            rollback_at=self.rollback_at,
            contributors=self.feed.take_contributors(),
        )
        self.rebased_from = None
        self.version = version
        self.feed.sealed(version)
        self.steps_since_publish = 0
        return version

    def _finish_publish(self) -> None:
        """Announce the written version, acknowledge its samples, prune old versions (retried if Redis fails)."""
        _, _, pruned = self.publisher.finish()
        self.feed.forget(pruned)
        self._status("waiting")

    def _unannounced_ids(self) -> set[str]:
        return set(self.publisher.unannounced[1]) if self.publisher.unannounced else set()

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
