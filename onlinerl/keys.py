"""Redis key and stream names: the single source for every component (see docs/architecture.md).

All keys of one job share the prefix ``orl:{job}:`` so several jobs can share one Redis, and a Redis Cluster
hash tag (``{job}``) keeps one job's keys on one slot, which the feedback Lua script needs.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

SAMPLES_GROUP = "trainers"
CHECKPOINTS_GROUP_PREFIX = "reloader"
RATED_FIELD_PREFIX = "rated:"


def prompt_digest(prompt: str) -> str:
    """Stable 128-bit digest of a rendered prompt: the join key between a completion and its feedback."""
    return hashlib.sha256(prompt.encode("utf-8", "surrogatepass")).hexdigest()[:32]


@dataclass(frozen=True)
class Keys:
    """Every Redis key of one job."""

    job: str

    @property
    def prefix(self) -> str:
        return f"orl:{{{self.job}}}:"

    # --- serving -> feedback ------------------------------------------------------------------------------------
    def rollouts(self, tenant: str, prompt: str) -> str:
        """Hash ``rollout_id -> RolloutRecord JSON`` of every completion served for one tenant and prompt (TTL)."""
        return f"{self.prefix}rollouts:{tenant}:{prompt_digest(prompt)}"

    @staticmethod
    def rated_field(rollout_id: str) -> str:
        """Field ``rated:{rollout_id}`` of the rollout's own ``rollouts:*`` hash: ``"<outcome> <entry id>"`` of the one
        feedback event that rated it (set by feedback in the same Lua script as the XADD). A field, not a key of its
        own, so it lives exactly as long as the record: the gateway refreshes the hash's TTL whenever that prompt is
        served again, so any fixed marker TTL could expire while the record is still joinable."""
        return f"{RATED_FIELD_PREFIX}{rollout_id}"

    # --- feedback -> trainer ------------------------------------------------------------------------------------
    @property
    def samples(self) -> str:
        """Stream of TrainingSample entries, consumed by group ``trainers``; trimmed only below the acked minimum."""
        return f"{self.prefix}samples"

    @property
    def audit(self) -> str:
        """Stream of feedback events that are not trained on (unmatched, altered, rejected); capped length."""
        return f"{self.prefix}audit"

    def seen(self, tenant: str, completion_id: str) -> str:
        """Idempotency marker for one Continue ``completionId`` (SET NX, TTL)."""
        return f"{self.prefix}seen:{tenant}:{completion_id}"

    # --- trainer -> reloader ------------------------------------------------------------------------------------
    @property
    def checkpoints(self) -> str:
        """Stream of published checkpoint announcements (version, path, manifest digest)."""
        return f"{self.prefix}checkpoints"

    # --- routing and rollout ------------------------------------------------------------------------------------
    @property
    def policy(self) -> str:
        """Hash: the live policy table (stable, candidate, canary_share, pinned, paused, updated_at)."""
        return f"{self.prefix}policy"

    @property
    def versions(self) -> str:
        """Hash ``version -> PolicyVersionState JSON`` kept by the reloader (loaded, failed, retired...)."""
        return f"{self.prefix}versions"

    @property
    def holds(self) -> str:
        """Hash ``version -> expiry (unix s)``: versions an evaluation uses; the reloader keeps them loaded."""
        return f"{self.prefix}holds"

    def stats(self, version: int, arm: str) -> str:
        """Hash of counters per (policy version, arm): shown, accepted, rejected, empty, served."""
        return f"{self.prefix}stats:v{version}:{arm}"

    @property
    def decisions(self) -> str:
        """Stream: every rollout decision (gate, promote, rollback, pin) with its figures."""
        return f"{self.prefix}decisions"

    @property
    def rollout(self) -> str:
        """Hash ``version -> RolloutState JSON``: the rollout controller's verdict per version it judged."""
        return f"{self.prefix}rollout"

    @property
    def trainer_status(self) -> str:
        """Hash: the trainer's live status (step, version, samples trained, last checkpoint time)."""
        return f"{self.prefix}trainer"

    @property
    def reloader_status(self) -> str:
        """Hash: the reloader's last action (last reload time, version, error)."""
        return f"{self.prefix}reloader"
