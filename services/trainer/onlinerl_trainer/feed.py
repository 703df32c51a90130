"""The sample feed (leader only): read batches from the stream, admit them, and turn rewards into advantages.

Admission = skip what was already trained (the ids of every kept manifest on the resumed lineage, plus the open
version's), decode, validate (validation.py), apply the staleness rule. What can never be trained is acknowledged at
once (fenced, stream.py); what was trained is acknowledged only with the version that holds it (publisher.py).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from onlinerl.config import TrainerConfig
from onlinerl.dataplane import audit
from onlinerl.schemas import AuditEntry, TrainingSample
from onlinerl_trainer.advantages import RunningBaseline, select_trainable
from onlinerl_trainer.batching import StreamSample, staleness, staleness_action
from onlinerl_trainer.metrics import TrainerMetrics
from onlinerl_trainer.stream import Entry, SampleStream
from onlinerl_trainer.validation import sample_problem

log = logging.getLogger("onlinerl.trainer")


@dataclass
class Recovery:
    claimed: int = 0  # entries taken over from other (dead) consumers
    already_trained: int = 0  # pending entries found in a manifest: acknowledged, not retrained
    replayed: int = 0  # pending entries that will be trained again


@dataclass
class Admitted:
    samples: list[StreamSample]
    advantages: list[float]


class SampleFeed:
    def __init__(
        self,
        stream: SampleStream,
        tcfg: TrainerConfig,
        metrics: TrainerMetrics,
        vocab_size: int,
        trained_by_version: dict[int, list[str]],
    ) -> None:
        self.stream = stream
        self.tcfg = tcfg
        self.algo = tcfg.algorithm
        self.metrics = metrics
        self.vocab_size = vocab_size
        self.baseline = RunningBaseline(self.algo.baseline_momentum)
        self.replay: deque[Entry] = deque()
        self.trained_by_version = trained_by_version  # kept versions -> their sample ids (in the resumed weights)
        self.trained_ids: set[str] = {sid for ids in trained_by_version.values() for sid in ids}
        self.open_ids: list[str] = []  # trained since the last published version (acknowledged with the next one)
        # tenant -> user hashes whose samples are in open_ids: the next manifest's lineage (`onlinerl forget`)
        self.open_contributors: dict[str, set[str]] = {}

    # --- start and Redis hiccups --------------------------------------------------------------------------------
    def recover(self) -> Recovery:
        """Claim dead consumers' entries; acknowledge our pending ones already in a kept version, replay the rest."""
        self.stream.ensure_group()
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
        return rec

    def requeue_own_pending(self, held: set[str]) -> None:
        """Entries delivered to us but neither trained, queued nor acknowledged go back to the replay queue."""
        held = held | set(self.open_ids) | {e.sample_id for e in self.replay}
        lost = [e for e in self.stream.own_pending() if e.sample_id not in held]
        self.replay.extend(lost)
        if lost:
            log.info("requeued %d delivered but untrained entries after a Redis error", len(lost))

    # --- reading ------------------------------------------------------------------------------------------------
    def collect(self, stop: threading.Event | None = None, poll_ms: int = 500, close_early=None) -> list[Entry]:
        """Up to :meth:`entries_per_batch` entries: recovered ones first, then new ones; a partial batch closes after
        ``batchTimeoutSeconds`` from its first entry. Returns early (maybe empty) when ``close_early()`` says so
        while nothing is waiting, so the loop can publish on time."""
        size = self.entries_per_batch()
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
            if not batch and close_early is not None and close_early():
                break
        return batch

    def entries_per_batch(self) -> int:
        """Entries to read for one update: ``batchSize``, divided by ``negativeSampleRate`` when rejects are
        subsampled. Nearly every event is a reject, so about that many entries hold ``batchSize`` trainable samples;
        reading only ``batchSize`` made each update ~2 samples (a 60-minute run's first minutes: 37 samples in 19
        updates), and a version every two such steps. ``batchTimeoutSeconds`` still closes a partial batch."""
        return math.ceil(self.tcfg.batch_size / self.algo.negative_sample_rate)

    # --- admission ----------------------------------------------------------------------------------------------
    def admit(self, entries: list[Entry], version: int, oldest_served: int | None = None) -> Admitted:
        """Trainable samples with their advantages; everything else is acknowledged here (or, when it was trained
        since the last publish, left for the version that holds it). ``oldest_served``: the oldest version
        serving may give users (staleness is measured against it, see batching.staleness)."""
        samples, discard, refused = self._admissible(entries, version, oldest_served)
        audit.record(self.stream.client, self.stream.keys, refused)  # before the ack: a failed write redelivers
        self.stream.ack(discard)
        if not samples:
            return Admitted([], [])
        chosen = select_trainable(
            [s.sample_id for s in samples],
            [s.sample.reward for s in samples],
            [s.sample.tenant for s in samples],
            self.algo,
            self.baseline,
            [s.sample.unseen for s in samples],
        )
        # rejects not drawn by negativeSampleRate (the kept ones carry their weight), and samples without gradient
        # (advantage 0, no KL or entropy term): both acknowledged untrained; on CPU the pass is the scarce resource
        self.metrics.subsampled.inc(len(chosen.subsampled))
        self.metrics.inert.inc(len(chosen.inert))
        self.stream.ack([samples[i].sample_id for i in chosen.subsampled + chosen.inert])
        return Admitted([samples[i] for i in chosen.train], chosen.advantages)

    def _admissible(
        self, entries: list[Entry], version: int, oldest_served: int | None = None
    ) -> tuple[list[StreamSample], list[str], list[bytes]]:
        """Skip what was already trained, decode, validate, apply the staleness rule. Returns (trainable samples, ids
        to acknowledge without training, audit entries of the refused ones). An id trained since the last publish (or
        twice in this batch) is skipped but not acknowledged: its acknowledgement comes with the version that holds
        it."""
        keep: list[StreamSample] = []
        discard: list[str] = []
        refused: list[bytes] = []
        open_version = set(self.open_ids)
        again: list[str] = []
        for e in entries:
            if e.sample_id in self.trained_ids or e.sample_id in open_version:
                again.append(e.sample_id)
                if e.sample_id in self.trained_ids:
                    discard.append(e.sample_id)
                continue
            open_version.add(e.sample_id)
            try:
                sample = TrainingSample.from_json(e.data)
            except Exception as exc:
                log.error("discarding undecodable stream entry %s: %s", e.sample_id, exc)
                self.metrics.invalid.labels("undecodable").inc()
                discard.append(e.sample_id)
                refused.append(_refusal(e.sample_id, None, "undecodable"))
                continue
            problem = sample_problem(sample, self.vocab_size, self.tcfg.max_seq_len)
            if problem is not None:
                counter = self.metrics.invalid if problem.kind == "invalid" else self.metrics.dropped
                counter.labels(problem.reason).inc()
                log.error("not training stream entry %s (%s): %s", e.sample_id, problem.reason, problem.detail)
                discard.append(e.sample_id)
                refused.append(_refusal(e.sample_id, sample, problem.reason))
                continue
            behind = staleness(sample.policy_version, version, oldest_served)
            self.metrics.staleness.observe(behind)
            stale = self.algo.staleness
            action = staleness_action(behind, stale.max_versions, stale.mode)
            if action == "drop":
                self.metrics.stale.labels("dropped").inc()
                discard.append(e.sample_id)
                serving = "" if oldest_served is None else f", oldest served v{oldest_served}"
                refused.append(
                    _refusal(
                        e.sample_id,
                        sample,
                        f"stale: behaviour v{sample.policy_version}, {behind} versions behind (trainer v{version}"
                        f"{serving})",
                    )
                )
                continue
            cap = None
            if action == "downweight":
                self.metrics.stale.labels("downweighted").inc()
                cap = stale.truncate_weight
            keep.append(StreamSample(e.sample_id, sample, behind, cap))
        if again:
            self.metrics.dropped.labels("already_trained").inc(len(again))
            log.warning(
                "%d entries delivered again are already trained, not training them twice: %s", len(again), again[:5]
            )
        return keep, discard, refused

    # --- bookkeeping after training and publishing --------------------------------------------------------------
    def trained(self, ids: list[str], contributors: Iterable[tuple[str, str]] = ()) -> None:
        """``contributors``: (tenant, user hash) of the samples trained, kept for the next manifest's lineage."""
        self.open_ids.extend(ids)
        for tenant, user in contributors:
            self.open_contributors.setdefault(tenant, set()).add(user)

    def take_contributors(self) -> dict[str, list[str]]:
        """The open version's contributors, sorted (its manifest's ``contributors``)."""
        return {tenant: sorted(users) for tenant, users in sorted(self.open_contributors.items())}

    def sealed(self, version: int) -> list[str]:
        """The open version became ``version``: its ids are now trained into a kept manifest."""
        ids, self.open_ids = self.open_ids, []
        self.open_contributors = {}
        self.trained_by_version[version] = ids
        self.trained_ids.update(ids)
        return ids

    def rebased(self, trained_by_version: dict[int, list[str]]) -> int:
        """The weights went back to an older version (a manual rollback): what was trained since the last publish
        is not in them any more, so those entries (still pending at our consumer) are trained again, and "already
        trained" means the new lineage's manifests. Returns how many entries were queued again."""
        untrained, self.open_ids = set(self.open_ids), []
        self.open_contributors = {}  # those entries are trained again, and counted again then
        self.trained_by_version = trained_by_version
        self.trained_ids = {sid for ids in trained_by_version.values() for sid in ids}
        queued = {e.sample_id for e in self.replay}
        again = [e for e in self.stream.own_pending() if e.sample_id in untrained and e.sample_id not in queued]
        self.replay.extend(again)
        return len(again)

    def forget(self, pruned: list[int]) -> None:
        """The set holds the ids of kept manifests, as a restart would rebuild it."""
        for v in pruned:
            self.trained_ids.difference_update(self.trained_by_version.pop(v, ()))


def _refusal(stream_id: str, sample: TrainingSample | None, reason: str) -> bytes:
    """The audit entry of a sample the trainer acknowledges without training (``sample`` None: undecodable)."""
    return AuditEntry(
        event_id=sample.event_id if sample else "",
        tenant=sample.tenant if sample else "",
        outcome="refused_by_trainer",
        reason=reason,
        rollout_id=sample.rollout_id if sample else "",
        stream_id=stream_id,
        user_hash=sample.user_hash if sample else "",  # whose sample: `onlinerl forget` finds the entry
    ).to_json()
