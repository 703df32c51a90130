"""``onlinerl forget``: delete what the data plane holds about one tenant or one user, and say which published
versions learned from them (issue 38).

What is deleted, in this order (each by the module of its key family, as the admin Redis user):
1. rollout records (prompt, completion, tokens) with their rated marks and index / silence entries: first, so no
   event can join one of them any more and make a new sample while the rest is deleted;
2. pending training samples (XDEL + XACK for the trainers' group);
3. audit entries;
4. per-user counters: contribution counters, user statistics, quarantine mark (by the key id) and the canaries'
   per-user ledger fields (by the user hash); tenant-wide also the idempotency marks.
Then the lineage: every announced version whose manifest lists the user (tenant) among its contributors, and every
later version trained from one of those (its descendants carry what it learned), on the shared policy's line and on
the tenant's own adapter line when it has one (issue 39: a project's samples train its own line; the per-user
ledgers of every line are cleared in step 4).

Concurrent writers (what is guaranteed): everything written before ``forget`` started is deleted, except a sample a
trainer had already read and not yet acknowledged (the report counts them: it may still train them into its next
version, which then shows in the lineage of a second run). A record or event of the user that arrives while it runs
may survive, since each step deletes what it finds when it scans. Revoke the user's key first (remove it from the
keys file): then nothing new can arrive and one run deletes everything.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import redis

from onlinerl.auth import KeyRing, user_hash
from onlinerl.dataplane import audit, checkpoints, limits, rollouts, samples, stats
from onlinerl.keys import Keys, tenant_problem


@dataclass(frozen=True)
class Who:
    """Whose data: a tenant, and optionally one user of it by its two ids (both derived from the API key): the
    ``user_hash`` records, samples, audit entries and ledgers carry, and the ``key_id`` the limits count by."""

    tenant: str
    user_hash: str | None = None
    key_id: str | None = None

    @classmethod
    def of_key(cls, tenant: str, api_key: str) -> Who:
        identity = KeyRing.from_mapping({"tenants": {tenant: {"keys": [api_key]}}}).identity_for(api_key)
        assert identity is not None
        return cls(tenant, user_hash(api_key), identity.key_id)


@dataclass
class ForgetReport:
    tenant: str
    user_hash: str | None
    deleted: dict[str, int] = field(default_factory=dict)
    samples_already_read_by_trainer: int = 0
    trained_versions: list[int] = field(default_factory=list)
    descendant_versions: list[int] = field(default_factory=list)
    # the tenant's own adapter line (issue 39), when it has announced versions: the same two lists on that line
    own_line_trained_versions: list[int] = field(default_factory=list)
    own_line_descendant_versions: list[int] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def trained_on(lineage: list[checkpoints.Announced], tenant: str, user: str | None) -> tuple[list[int], list[int]]:
    """Pure: (versions trained directly on the tenant's / user's samples, later versions trained from those)."""
    direct = sorted(
        a.version for a in lineage if tenant in a.contributors and (user is None or user in a.contributors[tenant])
    )
    tainted = set(direct)
    descendants = []
    for a in sorted(lineage, key=lambda a: a.version):
        if a.version not in tainted and a.parent in tainted:
            tainted.add(a.version)
            descendants.append(a.version)
    return direct, descendants


def forget(client: redis.Redis, keys: Keys, who: Who) -> ForgetReport:
    """Delete ``who``'s data (see the module doc for the order and the guarantees) and report it."""
    problem = tenant_problem(who.tenant)
    if problem is not None:
        raise ValueError(f"--tenant {who.tenant!r}: {problem}")
    report = ForgetReport(who.tenant, who.user_hash)
    rec = rollouts.forget_records(client, keys, who.tenant, who.user_hash)
    smp = samples.forget_samples(client, keys, who.tenant, who.user_hash)
    report.samples_already_read_by_trainer = smp.delivered
    audited = audit.forget(client, keys, who.tenant, who.user_hash)
    counters = limits.forget(client, keys, who.tenant, who.key_id) if who.key_id or who.user_hash is None else 0
    users = {who.user_hash} if who.user_hash else set(rec.users or ())
    ledger = stats.forget_users(client, keys, users)
    report.deleted = {
        "rollout_records": rec.records,
        "rated_marks": rec.rated_marks,
        "index_entries": rec.index_entries,
        "samples": smp.samples,
        "audit_entries": audited,
        "user_counters": counters,
        "ledger_fields": ledger,
        "idempotency_marks": smp.seen_marks,
    }
    report.trained_versions, report.descendant_versions = trained_on(
        checkpoints.lineage(client, keys), who.tenant, who.user_hash
    )
    report.own_line_trained_versions, report.own_line_descendant_versions = trained_on(
        checkpoints.lineage(client, keys.for_project(who.tenant)), who.tenant, who.user_hash
    )
    return report
