"""The publisher (leader only): write v{N+1} durably, announce it, then acknowledge its samples; prune old versions.

Order is the delivery invariant (docs/architecture.md): files + manifest + resume state on disk first, then the
announcement, then the acknowledgement. The announcement and the acknowledgement go through the fenced scripts of
fence.py, so a trainer that lost its lease can write a folder but never announce it or drop a sample; a refused
announcement removes the folder it wrote (it is on no lineage), and the caller exits.

One publisher per policy line (issue 39): the shared line's writes ``{checkpointDir}/{job}/v{N}`` and announces on the
job's ``checkpoints`` stream as always; a project's writes ``{job}/projects/{project}/v{N}`` (``onlinerl.lines``) with
``line`` in the manifest, announces on its line's stream under the same lease, and protects the versions its line's
replicas, holds and policy table use. Acknowledging goes through ``settle``: a sample that also trains another line
(``projects.trainShared``) leaves the stream only once every line that trained it has published it.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

import orjson
import redis
import torch

from onlinerl.config import OnlineRLConfig
from onlinerl.dataplane import checkpoints, holds, lines, policy, versions
from onlinerl.dataplane import trainer as trainer_status
from onlinerl.keys import SHARED_LINE, Keys
from onlinerl.lines import checkpoint_root
from onlinerl_trainer.adapters import adapter_key
from onlinerl_trainer.checkpoint import CheckpointStore, render_manifest
from onlinerl_trainer.fence import FencedOut, Lease
from onlinerl_trainer.head_files import ensure_base_dir_for
from onlinerl_trainer.metrics import TrainerMetrics
from onlinerl_trainer.policy import save_weights
from onlinerl_trainer.stream import SampleStream

log = logging.getLogger("onlinerl.trainer")


class Publisher:
    def __init__(
        self,
        cfg: OnlineRLConfig,
        client: redis.Redis,
        lease: Lease,
        stream: SampleStream,
        metrics: TrainerMetrics,
        model_path: Path,
        line: str = SHARED_LINE,
        settle: Callable[[Sequence[str]], object] | None = None,
    ) -> None:
        self.cfg = cfg
        self.tcfg = cfg.trainer
        self.line = line
        self.keys = Keys(cfg.job).for_project(line) if line else Keys(cfg.job)
        self.client = client
        self.lease = lease
        self.stream = stream
        # acknowledges what no other line still holds open (SampleFeed.settle); no stream: a publisher that only prunes
        self.settle = settle or (stream.ack if stream is not None else None)
        self.metrics = metrics
        self.model_path = Path(model_path)
        self.store = CheckpointStore(checkpoint_root(cfg.storage.checkpoint_dir, cfg.job, line))
        self.corrupt_versions: list[int] = []  # refused at resume, newest first
        self.unannounced: tuple[int, list[str]] | None = None  # on disk, XADD/ack still to do
        self.last_publish = time.monotonic()
        self._written: int = 0  # the last version this process wrote (removed again if its announcement is refused)

    # --- start-up -----------------------------------------------------------------------------------------------
    def newest_good_version(self) -> int:
        """The newest version whose files match its manifest. Every newer one is refused, loudly: a tampered or
        half-copied checkpoint is never loaded (followers check the same files, so every rank picks the same one)."""
        latest, refused = self.store.newest_good()
        for version, problems in refused.items():
            self.corrupt_versions.append(version)
            self.metrics.corrupt_checkpoints.inc()
            log.error(
                "refusing corrupt checkpoint v%d (%s): falling back to an older version", version, "; ".join(problems)
            )
        return latest

    def kept_sample_ids(self, latest: int) -> dict[int, list[str]]:
        """Sample ids of the kept versions on ``latest``'s lineage (``latest``, its parent, ...): exactly what the
        weights we resume from were trained on. A kept folder off that lineage (a refused version, or one a stale
        trainer wrote but could not announce) does not count: its samples are trained again, never dropped."""
        out: dict[int, list[str]] = {}
        kept = set(self.store.versions())
        version = latest
        while version and version in kept and version not in out:
            try:
                manifest = self.store.manifest(version)
            except Exception as exc:
                log.error("v%d's manifest is unreadable (%s): older sample ids are not known as trained", version, exc)
                break
            out[version] = list(manifest.sample_ids)
            version = manifest.parent_version
        oldest = min(out, default=latest)  # below the chain's end: pruned gaps, not forks
        off = sorted(v for v in kept if oldest < v <= latest and v not in out)
        if off:
            log.warning("kept versions %s are not on v%d's lineage: their samples do not count as trained", off, latest)
        return out

    def reannounce(self, version: int) -> None:
        """A crash between writing and announcing left ``version`` unannounced: announce it now."""
        self.store.clean_temp()
        if version and self.last_announced() < version:
            self.announce(version)

    # --- the durable half ---------------------------------------------------------------------------------------
    def write(
        self,
        *,
        parent: int,
        step: int,
        ids: list[str],
        stats: dict[str, float],
        weights: dict[str, torch.Tensor],
        module: torch.nn.Module,
        save_state: Callable[[Path], None],
        meta: dict,
        rebased_from: int | None = None,
        rollback_at: float | None = None,
        contributors: dict[str, list[str]] | None = None,
    ) -> int:
        """v{N+1} (weights + manifest) and its resume state on disk. Nothing is announced or acknowledged yet.
        ``rebased_from``, ``rollback_at``: the manifest's lineage after a manual rollback (Trainer.follow_rollback)."""
        self.lease.check()  # a trainer that already lost the lease writes nothing
        version = max(parent, self.store.latest(), *self.corrupt_versions) + 1  # a refused number stays used

        def manifest_for(files: dict[str, str]):
            return render_manifest(
                job=self.cfg.job,
                version=version,
                parent_version=parent,
                kind=self.tcfg.weights,
                base_model=str(self.model_path),
                step=step,
                sample_ids=ids,
                metrics=stats,
                files=files,
                rebased_from=rebased_from,
                rollback_at=rollback_at,
                contributors=contributors,
                line=self.line,
            )

        if self.tcfg.weights == "full":  # v0's weights with a head, before any version whose head vLLM would keep
            ensure_base_dir_for(module, self.store.root, self.model_path)
        self.store.publish(
            version, lambda tmp: save_weights(module, weights, tmp, adapter_key(self.line)), manifest_for
        )
        self._written = version
        self.store.save_state(version, save_state, meta)
        self.last_publish = time.monotonic()
        self.unannounced = (version, ids)
        return version

    # --- the announced half -------------------------------------------------------------------------------------
    def finish(self) -> tuple[int, list[str], list[int]]:
        """Announce the written version, acknowledge its samples, prune. Returns (version, ids, pruned versions)."""
        assert self.unannounced is not None
        version, ids = self.unannounced
        if self.last_announced() < version:
            try:
                self.announce(version)
            except FencedOut:
                self._remove_refused(version)
                raise
        self.settle(ids)
        self.unannounced = None
        self.metrics.published(version, self.line)
        self.metrics.last_checkpoint.set(time.time())
        pruned = self.store.prune(self.tcfg.checkpoint.keep, self.protected_versions())
        if pruned:
            log.info("pruned versions %s%s", pruned, self.of_line)
        field = f"last_checkpoint_at@{self.line}" if self.line else "last_checkpoint_at"
        trainer_status.write_status(self.client, self.keys, {field: repr(time.time())})
        log.info("published v%d%s (%d samples)", version, self.of_line, len(ids))
        return version, ids, pruned

    @property
    def of_line(self) -> str:
        """For log lines: '' on the shared line, else " of project <name>"."""
        return f" of project {self.line}" if self.line else ""

    def _remove_refused(self, version: int) -> None:
        """Our announcement was refused: the folder we wrote is on no lineage; the next trainer must not resume it."""
        if self._written != version or not self.store.path(version).exists():
            return
        trash = self.store.root / f".del-v{version}-{uuid.uuid4().hex}"
        os.rename(self.store.path(version), trash)
        shutil.rmtree(trash, ignore_errors=True)
        log.error("v%d was refused (fenced out): removed its folder, publishing nothing", version)

    def announce(self, version: int) -> None:
        """XADD the version (fenced). ``rollback_at``: the manual rollback its lineage follows (0.0: none), so that
        serving and the rollout never make stable or gate a version trained on weights a rollback dropped."""
        manifest = self.store.manifest(version)
        if self.line:  # the job's registry of project lines, before the line's first announcement (idempotent)
            lines.register(self.client, self.keys.shared, self.line)
        self.lease.announce(
            {
                "version": str(version),
                "path": str(self.store.path(version).resolve()),
                "kind": self.tcfg.weights,
                "manifest_sha256": self.store.manifest_sha256(version),
                "created_at": repr(time.time()),
                "rollback_at": repr(manifest.rollback_at or 0.0),
                # lineage for `onlinerl forget` (issue 38): who trained this version, and what it was trained from
                "parent_version": str(manifest.parent_version),
                "contributors": orjson.dumps(manifest.contributors).decode(),
            },
            self.keys.checkpoints,
        )

    def last_announced(self) -> int:
        return checkpoints.last_announced(self.client, self.keys)

    def due(self, open_ids: int, steps_since: int) -> bool:
        """Publish after ``checkpoint.everySteps`` steps or ``everySeconds``, when anything was trained."""
        if not open_ids:
            return False
        if steps_since >= self.tcfg.checkpoint.every_steps:
            return True
        every = self.tcfg.checkpoint.every_seconds
        return every > 0 and time.monotonic() - self.last_publish >= every

    def protected_versions(self) -> set[int]:
        """Versions any LIVE serving replica has loaded, is loading or may switch to (a dead replica stops pinning once
        its heartbeat lapses), versions an evaluation holds, and those the routing table points at."""
        protected = versions.read(self.client, self.keys).in_use()  # unreadable entries count as in use
        protected |= holds.read(self.client, self.keys)
        table = policy.read(self.client, self.keys)
        protected.update(v for v in (table.stable, table.candidate, table.pinned) if v)
        return protected
