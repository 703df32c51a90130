"""The trainer loop: batch samples from the stream, take PPO steps, publish checkpoints, then acknowledge.

Delivery invariant (docs/architecture.md): a sample leaves the stream only after the checkpoint it was trained into
is durably on disk and announced; each manifest lists its sample ids, so after a crash the trainer resumes from the
latest version and acknowledges (without retraining) pending samples that version already contains. Samples trained
after it are simply trained again on top of it: at least once delivery, exactly once in the published weights.

The ids of every kept manifest stay in memory (``trained_ids``), so an entry delivered again at any time (a Redis
failover that lost the group's last-delivered id and our XDELs) is acknowledged without training, not only at start.
Resume loads the newest version whose files match its manifest's sha256s; newer corrupt ones are refused loudly
(ERROR log, ``onlinerl_trainer_corrupt_checkpoints_total``, ``corrupt_versions`` in the status hash), their numbers
are never reused, and their sample ids do not count as trained (their weights are not the ones resumed from).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import redis
import torch

from onlinerl.config import OnlineRLConfig
from onlinerl.keys import Keys
from onlinerl.schemas import PolicyTable, PolicyVersionState, TrainingSample
from onlinerl_trainer.advantages import RunningBaseline, compute_advantages
from onlinerl_trainer.batching import StreamSample, collate, staleness_action
from onlinerl_trainer.checkpoint import CheckpointStore, render_manifest
from onlinerl_trainer.engine import build_engine
from onlinerl_trainer.metrics import TrainerMetrics
from onlinerl_trainer.policy import (
    all_finite,
    load_policy,
    load_reference,
    load_weights_from_checkpoint,
    save_weights,
)
from onlinerl_trainer.ranks import Ranks
from onlinerl_trainer.stream import DEFAULT_CONSUMER, Entry, SampleStream
from onlinerl_trainer.update import ppo_update
from onlinerl_trainer.validation import sample_problem

log = logging.getLogger("onlinerl.trainer")


class NonFiniteWeightsError(RuntimeError):
    """The weights went non-finite: nothing is published; restart resumes from the last good version."""


@dataclass
class Recovery:
    claimed: int = 0  # entries taken over from other (dead) consumers
    already_trained: int = 0  # pending entries found in a manifest: acknowledged, not retrained
    replayed: int = 0  # pending entries that will be trained again


def _vocab_size(model_path: Path) -> int:
    """Rows of the input embedding: a token id outside [0, vocab) cannot be trained (index error, or worse on GPU)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(text.vocab_size)


def _pad_id(model_path: Path) -> int:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
        value = getattr(config, name, None)
        if isinstance(value, list):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return 0


class Trainer:
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
    ) -> None:
        self.cfg = cfg
        self.ranks = ranks  # world > 1: this rank is the leader (talks to Redis) or a follower (see ranks.py)
        self.last_broadcast = time.monotonic()
        self.tcfg = cfg.trainer
        self.algo = cfg.trainer.algorithm
        self.keys = Keys(cfg.job)
        self.client = client
        self.model_path = Path(model_path)
        self.metrics = metrics or TrainerMetrics()
        self.store = CheckpointStore(Path(cfg.storage.checkpoint_dir) / cfg.job)
        self.stream = SampleStream(client, self.keys, consumer, claim_idle_ms)
        self.pad_id = _pad_id(self.model_path)
        self.vocab_size = _vocab_size(self.model_path)
        self.baseline = RunningBaseline(self.algo.baseline_momentum)
        self.version = 0
        self.step = 0
        self.samples_trained = 0
        self.pending_ack: list[str] = []  # trained since the last published version
        self.steps_since_publish = 0
        self.last_publish = time.monotonic()
        self.last_stats: dict[str, float] = {}
        self.replay: deque[Entry] = deque()
        self._unannounced: tuple[int, list[str]] | None = None  # published on disk, XADD/ack still to do
        self._tensorboard = self._open_tensorboard() if ranks.leader else None

        module = load_policy(self.model_path, self.tcfg)
        self.reference = load_reference(self.model_path, self.tcfg)
        self.corrupt_versions: list[int] = []  # refused at resume, newest first
        latest = self._newest_good_version()
        self.trained_by_version: dict[int, list[str]] = self._kept_sample_ids(latest)
        self.trained_ids: set[str] = {sid for ids in self.trained_by_version.values() for sid in ids}
        if latest:
            load_weights_from_checkpoint(module, self.store.path(latest))
        self.engine = build_engine(module, self.tcfg)
        if self.reference is not None:
            self.reference.to(self.engine.device)
        if latest:
            self._resume(latest)

    # --- start-up ---------------------------------------------------------------------------------------------------
    def _newest_good_version(self) -> int:
        """The newest version whose files match its manifest. Every newer one is refused, loudly: a tampered or
        half-copied checkpoint is never loaded (followers check the same files, so every rank picks the same one)."""
        for version in reversed(self.store.versions()):
            problems = self.store.problems(version)
            if not problems:
                return version
            self.corrupt_versions.append(version)
            self.metrics.corrupt_checkpoints.inc()
            log.error(
                "refusing corrupt checkpoint v%d (%s): falling back to an older version", version, "; ".join(problems)
            )
        return 0

    def _kept_sample_ids(self, latest: int) -> dict[int, list[str]]:
        """Sample ids of every kept version up to ``latest``: trained into the weights we resume from."""
        out: dict[int, list[str]] = {}
        for version in self.store.versions():
            if version > latest or version in self.corrupt_versions:
                continue
            try:
                out[version] = list(self.store.manifest(version).sample_ids)
            except Exception as exc:
                log.error("v%d's manifest is unreadable (%s): its sample ids are not known as trained", version, exc)
        return out

    def _resume(self, latest: int) -> None:
        self.version = latest
        manifest = self.store.manifest(latest)
        self.step = manifest.step
        state = self.store.state_for(latest)
        if state is None:
            log.warning("v%d has no saved optimizer state: resuming its weights with a fresh optimizer", latest)
            return
        directory, meta = state
        self.engine.load_state(directory)
        self.step = int(meta.get("step", self.step))
        self.samples_trained = int(meta.get("samples_trained", 0))
        self.baseline.load_state_dict(meta.get("baseline", {}))
        if "rng" in meta:
            random.seed(meta["rng"])
            torch.manual_seed(meta["rng"])
        log.info("resumed from v%d at step %d", latest, self.step)

    def start(self) -> Recovery:
        """Group, temp-dir cleanup, re-announce a version a crash left unannounced, then recover pending entries."""
        self.stream.ensure_group()
        self.store.clean_temp()
        if self.version and self._last_announced() < self.version:
            self._announce(self.version)
        owned = {e.sample_id for e in self.stream.own_pending()}
        rec = Recovery(claimed=len(self.stream.claim_abandoned() - owned))
        pending = self.stream.own_pending()
        done = [e.sample_id for e in pending if e.sample_id in self.trained_ids]
        self.stream.ack(done)
        self.metrics.dropped.labels("already_trained").inc(len(done))
        rest = [e for e in pending if e.sample_id not in self.trained_ids]
        self.replay.extend(rest)
        rec.already_trained, rec.replayed = len(done), len(rest)
        log.info(
            "recovery: claimed %d, acknowledged %d already trained, replaying %d",
            rec.claimed,
            rec.already_trained,
            rec.replayed,
        )
        self.client.hset(
            self.keys.trainer_status,
            mapping={"corrupt_versions": ",".join(str(v) for v in sorted(self.corrupt_versions))},
        )
        self._status("waiting")
        self.metrics.version.set(self.version)
        return rec

    # --- the loop ---------------------------------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        backoff = 0.5
        lost_entries = False
        while not stop.is_set():
            self._keep_followers_alive()
            try:
                if lost_entries:
                    self._requeue_own_pending()
                    lost_entries = False
                if self._unannounced:
                    self._finish_publish()
                if self.tcfg.suspend:
                    self._status("suspended")
                    stop.wait(1.0)
                    continue
                entries = self.collect(stop)
                if entries:
                    self.train_on(entries)
                if self.should_publish():
                    self.publish()
                backoff = 0.5
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                log.warning("redis unavailable (%s): retrying in %.1fs", exc, backoff)
                lost_entries = True  # a batch being collected was dropped from memory; it is still pending
                stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)
        if self.pending_ack or self._unannounced:
            self.publish()  # graceful stop: what was trained is published, then acknowledged
        self._command("stop")
        self._status("stopped")

    def _requeue_own_pending(self) -> None:
        """Entries delivered to us but neither trained, queued nor acknowledged go back to the replay queue."""
        held = set(self.pending_ack) | {e.sample_id for e in self.replay}
        if self._unannounced:
            held |= set(self._unannounced[1])
        lost = [e for e in self.stream.own_pending() if e.sample_id not in held]
        self.replay.extend(lost)
        if lost:
            log.info("requeued %d delivered but untrained entries after a Redis error", len(lost))

    def collect(self, stop: threading.Event | None = None, poll_ms: int = 500) -> list[Entry]:
        """Up to ``batchSize`` entries: recovered ones first, then new ones; a partial batch closes after
        ``batchTimeoutSeconds`` from its first entry. Returns early (maybe empty) to let the loop check triggers."""
        size = self.tcfg.batch_size
        batch: list[Entry] = []
        deadline: float | None = None
        while len(batch) < size and not (stop is not None and stop.is_set()):
            if self.replay:
                while self.replay and len(batch) < size:
                    batch.append(self.replay.popleft())
                deadline = deadline or time.monotonic() + self.tcfg.batch_timeout_seconds
                continue
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                break
            wait_ms = poll_ms if deadline is None else min(poll_ms, int((deadline - now) * 1000) + 1)
            new = self.stream.read_new(size - len(batch), wait_ms)
            if new and deadline is None:
                deadline = time.monotonic() + self.tcfg.batch_timeout_seconds
            batch.extend(new)
            if not batch and self.should_publish():
                break
        return batch

    def _admit(self, entries: list[Entry]) -> tuple[list[StreamSample], list[str]]:
        """Skip what was already trained, decode, validate, apply the staleness rule. Returns (trainable samples, ids
        to acknowledge without training). An id trained since the last publish (or twice in this batch) is skipped but
        not acknowledged: its acknowledgement comes with the version that holds it."""
        keep: list[StreamSample] = []
        discard: list[str] = []
        open_version = set(self.pending_ack)
        again: list[str] = []
        for e in entries:
            if e.sample_id in self.trained_ids or e.sample_id in open_version:
                again.append(e.sample_id)
                if e.sample_id in self.trained_ids:
                    discard.append(e.sample_id)
                continue
            open_version.add(e.sample_id)
            try:
                sample = TrainingSample.from_json(e.fields[b"data"])
            except Exception as exc:
                log.error("discarding undecodable stream entry %s: %s", e.sample_id, exc)
                self.metrics.invalid.labels("undecodable").inc()
                discard.append(e.sample_id)
                continue
            problem = sample_problem(sample, self.vocab_size, self.tcfg.max_seq_len)
            if problem is not None:
                counter = self.metrics.invalid if problem.kind == "invalid" else self.metrics.dropped
                counter.labels(problem.reason).inc()
                log.error("not training stream entry %s (%s): %s", e.sample_id, problem.reason, problem.detail)
                discard.append(e.sample_id)
                continue
            staleness = max(0, self.version - sample.policy_version)
            self.metrics.staleness.observe(staleness)
            action = staleness_action(
                sample.policy_version, self.version, self.algo.staleness.max_versions, self.algo.staleness.mode
            )
            if action == "drop":
                self.metrics.stale.labels("dropped").inc()
                discard.append(e.sample_id)
                continue
            cap = None
            if action == "downweight":
                self.metrics.stale.labels("downweighted").inc()
                cap = self.algo.staleness.truncate_weight
            keep.append(StreamSample(e.sample_id, sample, staleness, cap))
        if again:
            self.metrics.dropped.labels("already_trained").inc(len(again))
            log.warning(
                "%d entries delivered again are already trained, not training them twice: %s", len(again), again[:5]
            )
        return keep, discard

    def train_on(self, entries: list[Entry]) -> dict[str, float] | None:
        """One PPO update on these entries. Returns its statistics, or None when nothing was trainable/skipped."""
        samples, discard = self._admit(entries)
        if discard:
            self.stream.ack(discard)
        if not samples:
            return None
        rewards = [s.sample.reward for s in samples]
        tenants = [s.sample.tenant for s in samples]
        adv = compute_advantages(
            rewards,
            tenants,
            baseline=self.algo.baseline,
            running=self.baseline,
            normalize=self.algo.normalize_advantages,
        )
        samples, adv, inert = self._without_inert(samples, adv)
        if inert:
            self.stream.ack(inert)
        if not samples:
            return None
        batch = collate(samples, self.tcfg.max_seq_len, self.pad_id)
        self._status("training")
        self._command("train", (samples, adv))
        t0 = time.perf_counter()
        adv_t = torch.tensor(adv, dtype=torch.float32)
        result = self._update(batch, adv_t)
        elapsed = time.perf_counter() - t0
        ids = [s.sample_id for s in samples]
        if result.skipped_reason is not None:
            log.error("step skipped (%s): discarding %d samples", result.skipped_reason, len(ids))
            self.metrics.skipped.labels(result.skipped_reason).inc()
            self.stream.ack(ids)  # deliberately discarded: retrying a non-finite batch would loop forever
            self._status("waiting")
            return None
        self.step += 1
        self.steps_since_publish += 1
        self.samples_trained += len(ids)
        self.pending_ack.extend(ids)
        tokens = batch.num_tokens
        stats = {
            **result.stats,
            "grad_norm": result.grad_norm,
            "reward_mean": sum(rewards) / len(rewards),
            "advantage_mean": float(adv_t.mean()),
            "advantage_std": float(adv_t.std(unbiased=False)),
            "step_seconds": elapsed,
            "samples": float(len(ids)),
        }
        self.last_stats = stats
        m = self.metrics
        m.record_stats(stats)
        m.samples.inc(len(ids))
        m.tokens.inc(tokens)
        m.steps.inc()
        m.step_seconds.observe(elapsed)
        m.samples_per_second.set(len(ids) / max(elapsed, 1e-9))
        m.tokens_per_second.set(tokens / max(elapsed, 1e-9))
        if self._tensorboard is not None:
            for k, v in stats.items():
                self._tensorboard.add_scalar(f"trainer/{k}", v, self.step)
        self._status("waiting")
        return stats

    def _without_inert(
        self, samples: list[StreamSample], adv: list[float]
    ) -> tuple[list[StreamSample], list[float], list[str]]:
        """Drop samples whose gradient is exactly zero: advantage 0 with no KL or entropy term (with the ``rlinf``
        reward and no baseline, every reject). They are acknowledged without a forward pass, which on CPU is most of
        the trainer's time; the gradient is unchanged up to the token-mean scale, which Adam absorbs."""
        if self.algo.kl_coef > 0 or self.algo.entropy_coef > 0:
            return samples, adv, []
        keep = [i for i, a in enumerate(adv) if a != 0.0]
        if len(keep) == len(samples):
            return samples, adv, []
        inert = [s.sample_id for s, a in zip(samples, adv, strict=True) if a == 0.0]
        self.metrics.inert.inc(len(inert))
        return [samples[i] for i in keep], [adv[i] for i in keep], inert

    def _update(self, batch, advantages: torch.Tensor):
        return ppo_update(
            self.engine, batch, advantages, self.algo, self.tcfg.micro_batch_size, self.reference, self.ranks
        )

    # --- ranks ------------------------------------------------------------------------------------------------------
    def _command(self, name: str, payload: object = None) -> None:
        """Leader: send the followers their next piece of work (nothing happens in a single process)."""
        if self.ranks.distributed:
            self.ranks.broadcast((name, payload))
            self.last_broadcast = time.monotonic()

    def _keep_followers_alive(self, every_s: float = 60.0) -> None:
        if self.ranks.distributed and time.monotonic() - self.last_broadcast >= every_s:
            self._command("idle")

    def _trainable_weights(self) -> dict[str, torch.Tensor]:
        self._command("gather")
        return self.engine.trainable_state_dict()

    def _save_engine_state(self, directory: Path) -> None:
        self._command("save_state", str(directory))
        self.engine.save_state(directory)
        self.ranks.barrier()  # every rank's optimizer partition is on disk before the directory is renamed

    def follow(self) -> None:
        """A follower's whole life: do what the leader broadcasts until it says stop (see ranks.py)."""
        assert not self.ranks.leader
        while True:
            name, payload = self.ranks.broadcast(None)
            if name == "train":
                samples, adv = payload
                batch = collate(samples, self.tcfg.max_seq_len, self.pad_id)
                self._update(batch, torch.tensor(adv, dtype=torch.float32))
            elif name == "gather":
                self.engine.trainable_state_dict()
            elif name == "save_state":
                self.engine.save_state(Path(payload))
                self.ranks.barrier()
            elif name == "stop":
                return

    # --- publishing -------------------------------------------------------------------------------------------------
    def should_publish(self) -> bool:
        if not self.pending_ack:
            return False
        if self.steps_since_publish >= self.tcfg.checkpoint.every_steps:
            return True
        every = self.tcfg.checkpoint.every_seconds
        return every > 0 and time.monotonic() - self.last_publish >= every

    def publish(self) -> int | None:
        """Write v{N+1} (weights + manifest), save the resume state, announce, then acknowledge its samples."""
        if self._unannounced:
            self._finish_publish()
        if not self.pending_ack:
            return None
        version = self.write_version()
        self._finish_publish()
        return version

    def write_version(self) -> int:
        """The durable half of publishing: v{N+1} on disk and its resume state. Nothing is announced or acked yet."""
        self._status("publishing")
        weights = self._trainable_weights()
        if not all_finite(weights):
            self.metrics.skipped.labels("nonfinite_weights").inc()
            self._status("failed")
            raise NonFiniteWeightsError(f"non-finite weights after step {self.step}: v{self.version + 1} not published")
        version = max(self.version, self.store.latest(), *self.corrupt_versions) + 1  # a refused number stays used
        ids = list(self.pending_ack)
        metrics = {k: v for k, v in self.last_stats.items()}
        metrics["samples_trained_total"] = float(self.samples_trained)

        def write_files(tmp: Path) -> None:
            save_weights(self.engine.module, weights, tmp)

        def manifest_for(files: dict[str, str]):
            return render_manifest(
                job=self.cfg.job,
                version=version,
                parent_version=self.version,
                kind=self.tcfg.weights,
                base_model=str(self.model_path),
                step=self.step,
                sample_ids=ids,
                metrics=metrics,
                files=files,
            )

        self.store.publish(version, write_files, manifest_for)
        meta = {
            "step": self.step,
            "samples_trained": self.samples_trained,
            "baseline": self.baseline.state_dict(),
            "rng": random.randrange(2**31),
        }
        self.store.save_state(version, self._save_engine_state, meta)
        self.version = version
        self.trained_by_version[version] = ids
        self.trained_ids.update(ids)
        self.pending_ack = []
        self.steps_since_publish = 0
        self.last_publish = time.monotonic()
        self._unannounced = (version, ids)
        return version

    def _finish_publish(self) -> None:
        """Announce the published version, acknowledge its samples, prune old versions (retried if Redis fails)."""
        assert self._unannounced is not None
        version, ids = self._unannounced
        if self._last_announced() < version:
            self._announce(version)
        self.stream.ack(ids)
        self._unannounced = None
        self.metrics.version.set(version)
        self.metrics.last_checkpoint.set(time.time())
        pruned = self.store.prune(self.tcfg.checkpoint.keep, self._protected_versions())
        if pruned:
            log.info("pruned versions %s", pruned)
            for v in pruned:  # the set holds the ids of kept manifests, as a restart would rebuild it
                self.trained_ids.difference_update(self.trained_by_version.pop(v, ()))
        self.client.hset(self.keys.trainer_status, mapping={"last_checkpoint_at": repr(time.time())})
        self._status("waiting")
        log.info("published v%d (%d samples, step %d)", version, len(ids), self.step)

    def _announce(self, version: int) -> None:
        self.client.xadd(
            self.keys.checkpoints,
            {
                "version": str(version),
                "path": str(self.store.path(version).resolve()),
                "kind": self.tcfg.weights,
                "manifest_sha256": self.store.manifest_sha256(version),
                "created_at": repr(time.time()),
            },
        )

    def _last_announced(self) -> int:
        last = self.client.xrevrange(self.keys.checkpoints, count=1)
        if not last:
            return 0
        return int(last[0][1][b"version"])

    def _protected_versions(self) -> set[int]:
        """Versions a replica has loaded (or is loading) and versions the routing table points at."""
        protected: set[int] = set()
        for field, raw in self.client.hgetall(self.keys.versions).items():
            try:
                state = PolicyVersionState.from_json(raw)
            except Exception:
                protected.add(int(field))
                continue
            if state.state in ("loaded", "loading"):
                protected.add(state.version)
        table = PolicyTable.from_redis(self.client.hgetall(self.keys.policy))
        protected.update(v for v in (table.stable, table.candidate, table.pinned) if v)
        return protected

    # --- status -----------------------------------------------------------------------------------------------------
    def _status(self, state: str) -> None:
        self.client.hset(
            self.keys.trainer_status,
            mapping={
                "step": str(self.step),
                "version": str(self.version),
                "samples_trained": str(self.samples_trained),
                "state": state,
                "engine": self.engine.name if hasattr(self, "engine") else "",
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
        if self._tensorboard is not None:
            self._tensorboard.close()
