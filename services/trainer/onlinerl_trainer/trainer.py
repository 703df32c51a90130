"""The trainer loop: batch samples from the stream, take PPO steps, publish checkpoints, then acknowledge.

Delivery invariant (docs/architecture.md): a sample leaves the stream only after the checkpoint it was trained into
is durably on disk and announced; each manifest lists its sample ids, so after a crash the trainer resumes from the
latest version and acknowledges (without retraining) pending samples that version already contains. Samples trained
after it are simply trained again on top of it: at least once delivery, exactly once in the published weights.
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

from onlinerl.config import OnlineRLConfig
from onlinerl.keys import Keys
from onlinerl.schemas import PolicyTable, PolicyVersionState, TrainingSample

log = logging.getLogger("onlinerl.trainer")


class NonFiniteWeightsError(RuntimeError):
    """The weights went non-finite: nothing is published; restart resumes from the last good version."""


@dataclass
class Recovery:
    claimed: int = 0  # entries taken over from other (dead) consumers
    already_trained: int = 0  # pending entries found in a manifest: acknowledged, not retrained
    replayed: int = 0  # pending entries that will be trained again


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
        latest = self.store.latest()
        if latest:
            load_weights_from_checkpoint(module, self.store.path(latest))
        self.engine = build_engine(module, self.tcfg)
        if self.reference is not None:
            self.reference.to(self.engine.device)
        if latest:
            self._resume(latest)

    # --- start-up ---------------------------------------------------------------------------------------------------
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
        trained = self.store.trained_sample_ids()
        done = [e.sample_id for e in pending if e.sample_id in trained]
        self.stream.ack(done)
        rest = [e for e in pending if e.sample_id not in trained]
        self.replay.extend(rest)
        rec.already_trained, rec.replayed = len(done), len(rest)
        log.info(
            "recovery: claimed %d, acknowledged %d already trained, replaying %d",
            rec.claimed,
            rec.already_trained,
            rec.replayed,
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
        """Decode and apply the staleness rule. Returns (trainable samples, ids to acknowledge without training)."""
        keep: list[StreamSample] = []
        discard: list[str] = []
        for e in entries:
            try:
                sample = TrainingSample.from_json(e.fields[b"data"])
                if not sample.completion_token_ids or not sample.prompt_token_ids:
                    raise ValueError("empty prompt or completion")
                if len(sample.behaviour_logprobs) != len(sample.completion_token_ids):
                    raise ValueError("behaviour_logprobs and completion_token_ids differ in length")
            except Exception as exc:
                log.error("discarding invalid stream entry %s: %s", e.sample_id, exc)
                self.metrics.invalid.inc()
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
        version = max(self.version, self.store.latest()) + 1
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
