"""The sample feed (leader only): read batches from the stream, admit them, and turn rewards into advantages.

Admission = skip what was already trained (the ids of every kept manifest on the resumed lineage, plus the open
version's), decode, validate (validation.py), apply the staleness rule. What can never be trained is acknowledged at
once (fenced, stream.py); what was trained is acknowledged only with the version that holds it (publisher.py).

Per-project adapters (issue 39): ``router`` says which policy lines a sample trains (routing.py; the trainer's rule,
default: the shared line alone) and each line keeps its own :class:`Ledger` of what it trained. Admission splits a
batch by line (an update never mixes lines), skips a sample on the lines that already hold it, and measures its
staleness on the line that served it (``position``). A sample is acknowledged once no line holds it open and none
still has to train it (:meth:`SampleFeed.settle`): with ``projects.trainShared`` that is after both its lines
published it.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from onlinerl.config import TrainerConfig
from onlinerl.dataplane import audit
from onlinerl.keys import SHARED_LINE
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


Router = Callable[[str, TrainingSample], Sequence[str]]
"""(stream id, sample) -> the policy lines it trains (the trainer's routing rule)."""
Position = Callable[[TrainingSample], tuple[int, "int | None"]]
"""sample -> (version, oldest served version) of the line that served it: what its staleness is measured on."""


def _shared_only(_sample_id: str, _sample: TrainingSample) -> Sequence[str]:
    return (SHARED_LINE,)


class Ledger:
    """What one policy line trained: the ids in its kept versions (on the resumed lineage) and those trained since
    its last publish (acknowledged with its next version), with their contributors (the next manifest's lineage)."""

    def __init__(self, trained_by_version: dict[int, list[str]]) -> None:
        self.trained_by_version = trained_by_version  # kept versions -> their sample ids (in the resumed weights)
        self.trained_ids: set[str] = {sid for ids in trained_by_version.values() for sid in ids}
        self.open_ids: list[str] = []  # trained since the last published version (acknowledged with the next one)
        self.open_set: set[str] = set()
        # tenant -> user hashes whose samples are in open_ids: the next manifest's lineage (`onlinerl forget`)
        self.open_contributors: dict[str, set[str]] = {}

    def holds(self, sample_id: str) -> bool:
        return sample_id in self.trained_ids or sample_id in self.open_set

    def trained(self, ids: list[str], contributors: Iterable[tuple[str, str]] = ()) -> None:
        self.open_ids.extend(ids)
        self.open_set.update(ids)
        for tenant, user in contributors:
            self.open_contributors.setdefault(tenant, set()).add(user)

    def take_contributors(self) -> dict[str, list[str]]:
        return {tenant: sorted(users) for tenant, users in sorted(self.open_contributors.items())}

    def sealed(self, version: int) -> list[str]:
        ids, self.open_ids, self.open_set = self.open_ids, [], set()
        self.open_contributors = {}
        self.trained_by_version[version] = ids
        self.trained_ids.update(ids)
        return ids

    def rebased(self, trained_by_version: dict[int, list[str]]) -> set[str]:
        """The weights went back to an older version: returns the ids trained since the last publish (no longer in
        the weights); "trained" now means the new lineage's manifests."""
        untrained = set(self.open_ids)
        self.open_ids, self.open_set, self.open_contributors = [], set(), {}
        self.trained_by_version = trained_by_version
        self.trained_ids = {sid for ids in trained_by_version.values() for sid in ids}
        return untrained

    def forget(self, pruned: list[int]) -> None:
        for v in pruned:
            self.trained_ids.difference_update(self.trained_by_version.pop(v, ()))


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
        self.ledgers: dict[str, Ledger] = {SHARED_LINE: Ledger(trained_by_version)}
        self.router: Router = _shared_only

    # --- the shared line's ledger, by the names tests and tools use ----------------------------------------------
    @property
    def trained_ids(self) -> set[str]:
        return self.ledgers[SHARED_LINE].trained_ids

    @property
    def open_ids(self) -> list[str]:
        return self.ledgers[SHARED_LINE].open_ids

    @property
    def trained_by_version(self) -> dict[int, list[str]]:
        return self.ledgers[SHARED_LINE].trained_by_version

    def add_line(self, line: str, trained_by_version: dict[int, list[str]]) -> None:
        """A project line opened (or resumed): its own ledger, from its kept versions."""
        self.ledgers[line] = Ledger(trained_by_version)

    def holds_open(self, sample_id: str) -> bool:
        """Some line trained it since its last publish: its acknowledgement comes with that line's version."""
        return any(sample_id in ledger.open_set for ledger in self.ledgers.values())

    def settle(self, ids: Sequence[str]) -> int:
        """Acknowledge those of ``ids`` no line holds open and none is queued to train again (fenced). Returns how
        many went."""
        queued = {e.sample_id for e in self.replay} if self.replay else set()
        done = [sid for sid in ids if not self.holds_open(sid) and sid not in queued]
        self.stream.ack(done)
        return len(done)

    # --- start and Redis hiccups --------------------------------------------------------------------------------
    def recover(self) -> Recovery:
        """Claim dead consumers' entries; acknowledge our pending ones already in a kept version, replay the rest."""
        self.stream.ensure_group()
        owned = {e.sample_id for e in self.stream.own_pending()}
        rec = Recovery(claimed=len(self.stream.claim_abandoned() - owned))
        pending = self.stream.own_pending()
        done = [e.sample_id for e in pending if self._trained_everywhere(e)]
        self.stream.ack(done)
        self.metrics.dropped.labels("already_trained").inc(len(done))
        finished = set(done)
        rest = [e for e in pending if e.sample_id not in finished]
        self.replay.extend(rest)
        rec.already_trained, rec.replayed = len(done), len(rest)
        log.info(
            "recovery: claimed %d, acknowledged %d already trained, replaying %d",
            rec.claimed,
            rec.already_trained,
            rec.replayed,
        )
        return rec

    def _trained_everywhere(self, entry: Entry) -> bool:
        """Every line this entry trains holds it in a kept version (one line: no need to decode it)."""
        if len(self.ledgers) == 1:
            return entry.sample_id in self.trained_ids
        try:
            sample = TrainingSample.from_json(entry.data)
        except Exception:
            return False  # admission refuses it, with its audit entry
        lines = self.router(entry.sample_id, sample)
        return all(entry.sample_id in self.ledgers[line].trained_ids for line in lines)

    def requeue_own_pending(self, held: set[str]) -> None:
        """Entries delivered to us but neither trained, queued nor acknowledged go back to the replay queue."""
        held = held | {sid for ledger in self.ledgers.values() for sid in ledger.open_ids}
        held |= {e.sample_id for e in self.replay}
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
        """The shared line's trainable samples with their advantages (:meth:`admit_lines` with every sample served
        at ``version`` / ``oldest_served``: one policy line, as before per-project adapters)."""
        admitted = self.admit_lines(entries, lambda _sample: (version, oldest_served))
        return admitted.get(SHARED_LINE, Admitted([], []))

    def admit_lines(self, entries: list[Entry], position: Position) -> dict[str, Admitted]:
        """Trainable samples with their advantages, per policy line (``router``); everything else is acknowledged
        here (or, when a line trained it since its last publish, left for the version that holds it). ``position``:
        the version and the oldest served version of the line that served a sample (staleness is measured against
        them, see batching.staleness)."""
        by_line, discard, refused = self._admissible(entries, position)
        audit.record(self.stream.client, self.stream.keys, refused)  # before the ack: a failed write redelivers
        unique = list({s.sample_id: s for rows in by_line.values() for s in rows}.values())
        if not unique:
            self.settle(discard)
            return {}
        # One advantage per sample, however many lines it trains: the baseline sees each reward once.
        chosen = select_trainable(
            [s.sample_id for s in unique],
            [s.sample.reward for s in unique],
            [s.sample.tenant for s in unique],
            self.algo,
            self.baseline,
            [s.sample.unseen for s in unique],
        )
        # rejects not drawn by negativeSampleRate (the kept ones carry their weight), and samples without gradient
        # (advantage 0, no KL or entropy term): both acknowledged untrained; on CPU the pass is the scarce resource
        self.metrics.subsampled.inc(len(chosen.subsampled))
        self.metrics.inert.inc(len(chosen.inert))
        self.settle([*discard, *(unique[i].sample_id for i in chosen.subsampled + chosen.inert)])
        advantage = {unique[i].sample_id: a for i, a in zip(chosen.train, chosen.advantages, strict=True)}
        out: dict[str, Admitted] = {}
        for line, rows in by_line.items():
            kept = [r for r in rows if r.sample_id in advantage]
            if kept:
                out[line] = Admitted(kept, [advantage[r.sample_id] for r in kept])
        return out

    def _admissible(
        self, entries: list[Entry], position: Position
    ) -> tuple[dict[str, list[StreamSample]], list[str], list[bytes]]:
        """Decode, validate, route, skip the lines that already hold a sample, apply the staleness rule. Returns
        (trainable samples per line, ids no line trains now, audit entries of the refused ones). An id a line
        trained since its last publish (or twice in this batch) is not trained again there and not acknowledged
        while a line holds it open: its acknowledgement comes with the version that holds it."""
        by_line: dict[str, list[StreamSample]] = {}
        discard: list[str] = []
        refused: list[bytes] = []
        in_batch: set[str] = set()
        again: list[str] = []
        for e in entries:
            if e.sample_id in in_batch:
                again.append(e.sample_id)
                continue
            in_batch.add(e.sample_id)
            if len(self.ledgers) == 1 and self.ledgers[SHARED_LINE].holds(e.sample_id):  # no need to decode it
                again.append(e.sample_id)
                discard.append(e.sample_id)
                continue
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
            lines = self.router(e.sample_id, sample)
            todo = [line for line in lines if not self.ledgers[line].holds(e.sample_id)]
            if len(todo) < len(lines):
                again.append(e.sample_id)
            if not todo:
                discard.append(e.sample_id)  # settle: acknowledged unless a line still holds it open
                continue
            version, oldest_served = position(sample)
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
            row = StreamSample(e.sample_id, sample, behind, cap)
            for line in todo:
                by_line.setdefault(line, []).append(row)
        if again:
            self.metrics.dropped.labels("already_trained").inc(len(again))
            log.warning(
                "%d entries delivered again are already trained, not training them twice: %s", len(again), again[:5]
            )
        return by_line, discard, refused

    # --- bookkeeping after training and publishing (per line; the shared line by default) ----------------------
    def trained(self, ids: list[str], contributors: Iterable[tuple[str, str]] = (), line: str = SHARED_LINE) -> None:
        """``contributors``: (tenant, user hash) of the samples trained, kept for the next manifest's lineage."""
        self.ledgers[line].trained(ids, contributors)

    def take_contributors(self, line: str = SHARED_LINE) -> dict[str, list[str]]:
        """The open version's contributors, sorted (its manifest's ``contributors``)."""
        return self.ledgers[line].take_contributors()

    def sealed(self, version: int, line: str = SHARED_LINE) -> list[str]:
        """The line's open version became ``version``: its ids are now trained into a kept manifest."""
        return self.ledgers[line].sealed(version)

    def rebased(self, trained_by_version: dict[int, list[str]], line: str = SHARED_LINE) -> int:
        """The line's weights went back to an older version (a manual rollback): what it trained since its last
        publish is not in them any more, so those entries (still pending at our consumer) are trained again, and
        "already trained" means the new lineage's manifests. Returns how many entries were queued again."""
        untrained = self.ledgers[line].rebased(trained_by_version)
        queued = {e.sample_id for e in self.replay}
        again = [e for e in self.stream.own_pending() if e.sample_id in untrained and e.sample_id not in queued]
        self.replay.extend(again)
        return len(again)

    def forget(self, pruned: list[int], line: str = SHARED_LINE) -> None:
        """The line's set holds the ids of its kept manifests, as a restart would rebuild it."""
        self.ledgers[line].forget(pruned)


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
