"""Redis key and stream names: the single source for every component (see docs/architecture.md).

All keys of one job share the prefix ``orl:{job}:`` so several jobs can share one Redis, and a Redis Cluster
hash tag (``{job}``) keeps one job's keys on one slot, which the feedback Lua script needs.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

SAMPLES_GROUP = "trainers"
CHECKPOINTS_GROUP_PREFIX = "reloader"
RATED_FIELD_PREFIX = "rated:"


# A tenant's name is part of its Redis keys (``rollouts:{tenant}:{digest}``, ``silence:{tenant}``...), where ``:``
# separates the parts and braces make a Cluster hash tag: a tenant named ``acme:x`` or ``a}b`` could address another
# tenant's keys. One rule for every place a tenant is defined (the keys file, the config, the operator's spec).
TENANT_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
TENANT_RULE = (
    "1 to 63 characters of letters, digits, '_', '.' and '-', starting with a letter or digit (no ':', braces, "
    "spaces or other characters that could run into another tenant's Redis keys)"
)


def tenant_problem(name: object) -> str | None:
    """Why ``name`` cannot be a tenant (a sentence naming it and the rule), or None when it can."""
    if not isinstance(name, str):
        return f"tenant name {name!r} is not a string: quote it (a tenant name is {TENANT_RULE})"
    if TENANT_PATTERN.fullmatch(name):
        return None
    return f"tenant name {name!r} is not allowed: a tenant name is {TENANT_RULE}"


def prompt_digest(prompt: str) -> str:
    """Stable 128-bit digest of a rendered prompt: the join key between a completion and its feedback."""
    return hashlib.sha256(prompt.encode("utf-8", "surrogatepass")).hexdigest()[:32]


SHARED_LINE = ""


@dataclass(frozen=True)
class Keys:
    """Every Redis key of one job, as seen by one policy line.

    A *line* is one policy and everything that decides what it serves: its version line and checkpoints stream,
    policy table, holds, per-version stats, rollout verdicts and decisions (docs/per-project-adapters.md).
    ``line=""`` is the shared policy, with the names it always had; ``Keys(job).for_project("acme")`` names project
    ``acme``'s own adapter line, under ``orl:{job}:p:acme:``. What belongs to the job, not to a policy (samples,
    audit, idempotency marks, user ledgers, replicas, the trainer's lease and fence, the services' status hashes),
    keeps one name whatever the line, so a component that serves or trains many lines shares them.
    """

    job: str
    line: str = SHARED_LINE

    @property
    def prefix(self) -> str:
        return f"orl:{{{self.job}}}:"

    @property
    def line_prefix(self) -> str:
        """Prefix of the keys that belong to one policy line (the job prefix for the shared line)."""
        return f"{self.prefix}p:{self.line}:" if self.line else self.prefix

    def for_project(self, project: str) -> Keys:
        """The keys of ``project``'s own adapter line (a project is the tenant its API keys belong to)."""
        problem = tenant_problem(project)
        if problem:
            raise ValueError(problem)
        return Keys(self.job, project)

    @property
    def shared(self) -> Keys:
        """The keys of the shared policy line."""
        return Keys(self.job)

    def for_line(self, line: str) -> Keys:
        """The keys of ``line`` as records name it (``RolloutRecord.line``): '' the shared line, else that project's."""
        return self.for_project(line) if line else self.shared

    # --- serving -> feedback ------------------------------------------------------------------------------------
    def rollouts(self, tenant: str, prompt: str) -> str:
        """Hash ``rollout_id -> RolloutRecord JSON`` of every completion served for one tenant and prompt (a TTL per
        field, so each record expires on its own: onlinerl/dataplane/rollouts.py)."""
        return f"{self.prefix}rollouts:{tenant}:{prompt_digest(prompt)}"

    @staticmethod
    def rated_field(rollout_id: str) -> str:
        """Field ``rated:{rollout_id}`` of the rollout's own ``rollouts:*`` hash: ``"<outcome> <entry id>"`` of the one
        feedback event that rated it (set by feedback in the same Lua script as the XADD). A field of the record's own
        hash with its own field TTL, set so that it outlives the record it guards (onlinerl/dataplane/rollouts.py)."""
        return f"{RATED_FIELD_PREFIX}{rollout_id}"

    def rollouts_by_digest(self, tenant: str, digest: str) -> str:
        """The same ``rollouts:*`` hash named by its prompt digest (a due entry holds the digest, not the prompt)."""
        return f"{self.prefix}rollouts:{tenant}:{digest}"

    def rollouts_index(self, tenant: str) -> str:
        """Sorted set ``"<prompt digest> <rollout_id>"`` scored by finish time: every live record of a tenant, so the
        gateway's record script can cap the tenant at ``serving.maxRecordsPerTenant`` by evicting its oldest."""
        return f"{self.prefix}rollouts-index:{tenant}"

    def silence_due(self, tenant: str) -> str:
        """Sorted set ``"<prompt digest> <rollout_id>"`` scored by the rollout's finish time (unix s): rollouts of a
        tenant with silence tracking on that may still get no outcome. The gateway adds them in its record script;
        feedback's silence sweeper removes each once, after ``feedback.silence.windowSeconds``."""
        return f"{self.prefix}silence:{tenant}"

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

    # --- contribution limits and quarantine (feedback; services/feedback/onlinerl_feedback/limits.py) -----------
    def contrib(self, tenant: str, user: str, hour: int) -> str:
        """Counter of one user's counted events in one clock hour (``hour`` = unix time // 3600; TTL 2 h)."""
        return f"{self.prefix}contrib:{tenant}:{user}:{hour}"

    def user_stats(self, tenant: str, user: str = "") -> str:
        """Hash ``shown``/``accepted`` of one user (or, with ``user`` empty, of the whole tenant): the anomaly test."""
        return f"{self.prefix}ustats:{tenant}:{user}" if user else f"{self.prefix}ustats:{tenant}"

    def quarantine(self, tenant: str, user: str) -> str:
        """Set (no TTL) while a user's feedback is quarantined; an admin deletes it to release the user."""
        return f"{self.prefix}quarantine:{tenant}:{user}"

    # --- policy lines (issue 39) ------------------------------------------------------------------------------------
    @property
    def lines(self) -> str:
        """Set of the job's project line names (job-wide, one name on every line): each project that has a policy line
        of its own, registered when its line first gets a version, so the rollout controller, `onlinerl status` and
        the operator find every line of ``projects.adapters: all`` without a SCAN (onlinerl/dataplane/lines.py)."""
        return f"{self.prefix}lines"

    # --- trainer -> reloader ------------------------------------------------------------------------------------
    @property
    def checkpoints(self) -> str:
        """Stream of published checkpoint announcements (version, path, manifest digest)."""
        return f"{self.line_prefix}checkpoints"

    # --- routing and rollout ------------------------------------------------------------------------------------
    @property
    def policy(self) -> str:
        """Hash: the live policy table (stable, candidate, canary_share, pinned, paused, updated_at)."""
        return f"{self.line_prefix}policy"

    @property
    def replicas(self) -> str:
        """Sorted set ``replica id -> heartbeat deadline`` (unix s, the server's clock): the live serving replicas are
        those whose deadline is ahead (onlinerl/dataplane/versions.py)."""
        return f"{self.prefix}replicas"

    def replica_versions(self, replica: str) -> str:
        """Hash ``version -> PolicyVersionState JSON`` of one serving replica's reloader (expires with its heartbeat).
        ``replica`` must pass ``versions.valid_replica`` (no glob, brace or colon characters)."""
        return f"{self.line_prefix}versions:{replica}"

    @property
    def holds(self) -> str:
        """Hash ``version -> expiry (unix s)``: versions an evaluation uses; the reloader keeps them loaded."""
        return f"{self.line_prefix}holds"

    def stats(self, version: int, arm: str) -> str:
        """Hash of counters per (policy version, arm): shown, accepted, rejected, empty, served."""
        return f"{self.line_prefix}stats:v{version}:{arm}"

    def arm_users(self, version: int, arm: str, canary: int) -> str:
        """Hash ``{user}:{counter} -> count``: one canary's per-user share of ``stats(version, arm)`` (``canary``: the
        candidate version the policy table named when the rollout was routed). The rollout controller caps each
        user's contribution and checks that no verdict rests on one user (services/rollout/onlinerl_rollout/
        per_user.py). Under ``stats:`` because the same components write and read it."""
        return f"{self.line_prefix}stats:v{version}:{arm}:users:c{canary}"

    @property
    def decisions(self) -> str:
        """Stream: every rollout decision (gate, promote, rollback, pin) with its figures."""
        return f"{self.line_prefix}decisions"

    @property
    def rollout(self) -> str:
        """Hash ``version -> RolloutState JSON``: the rollout controller's verdict per version it judged."""
        return f"{self.line_prefix}rollout"

    @property
    def controller_status(self) -> str:
        """Hash ``activity``, ``since`` (unix s): what the rollout controller is doing that the policy table does not
        show (an eval gate running, a version waiting for stable's baseline, a gate backing off); empty when idle."""
        return f"{self.line_prefix}controller"

    @property
    def trainer_status(self) -> str:
        """Hash: the trainer's live status (step, version, samples trained, last checkpoint time)."""
        return f"{self.prefix}trainer"

    @property
    def trainer_lease(self) -> str:
        """String ``"<token> <holder>"`` (SET NX PX, renewed): the one trainer allowed to announce and acknowledge."""
        return f"{self.prefix}trainer:lease"

    @property
    def trainer_fence(self) -> str:
        """Counter (INCR): the fencing token of each lease taken; the trainer's Lua scripts refuse any older token."""
        return f"{self.prefix}trainer:fence"

    @property
    def reloader_status(self) -> str:
        """Hash: the reloader's last action (last reload time, version, error)."""
        return f"{self.prefix}reloader"
