"""The samples family (``samples`` stream, ``seen:*`` idempotency marks): feedback appends, the trainer consumes.

Writer: feedback's ``APPEND`` script (dedupe check, rated check, contribution limit and quarantine, XADD, the ``seen``
and ``rated`` marks and the stats counters, all or nothing; see onlinerl_feedback/store.py for why). Consumer: the
trainer, through group ``trainers`` (``SampleStream``): read, recover after a crash, acknowledge after a checkpoint.
Acknowledging is XACK + XDEL in one fenced Lua script (``trainer.Lease.ack``: refused unless this trainer holds the
lease), so ``XLEN samples`` (the backlog) shrinks only when a sample is trained into a durable checkpoint (or
deliberately discarded). The consumer name is stable per job (not per process), so a restarted trainer finds its own
pending entries at once; entries of any other consumer are taken over by XAUTOCLAIM once idle longer than
``claim_idle_ms``. Reader: the feedback service's backlog monitor (XLEN, the group's lag).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import redis
from redis.exceptions import ResponseError

from onlinerl.dataplane.codec import DATA, entries, matching_entries, text
from onlinerl.dataplane.scripts import Caller, Script
from onlinerl.dataplane.trainer import Lease
from onlinerl.keys import SAMPLES_GROUP, Keys

DEFAULT_CONSUMER = "trainer-0"

# KEYS: seen, stream, audit, rollouts hash, stats, contrib counter, quarantine mark, user stats, tenant stats, the
#       canary's per-user ledger (an unused rollouts/stats/ledger key is a placeholder under the job's prefix; the
#       script does not touch it).
# ARGV: 1 dedupe ttl, 2 entry json, 3 maxlen (0 = never trim), 4 outcome, 5 rated field ('' = none), 6 rollout ttl,
#       7 audit maxlen, 8-17 the limit step (limits.py: subject, limit, limited entry, quarantined entry, k, min shown,
#       stats window, shown, accepted, limited outcome), 18 ledger field prefix ("<user>:", '' = no ledger), 19 ledger
#       ttl, then (stats field, amount) pairs: each bumps the arm's stats and, with a ledger, "<user>:<field>" there.
# The anomaly test is two-sided: a user whose accept rate is more than k binomial sigmas above OR below the rest of
# the tenant is quarantined (a key that rejects everything steers a canary as much as one that accepts everything),
# and its counts leave the tenant's totals, so the outlier does not become the baseline the honest users are tested on.
# Replies: {1, entry id, newly quarantined 0|1} appended as decided; {3, audit id} over the contribution limit;
#          {4, audit id} user quarantined; {0, "<outcome> <id>"} completionId seen; {2, "<outcome> <id>"} rollout rated.
APPEND = Script("""
local prev = redis.call('GET', KEYS[1])
if prev then return {0, prev} end
local rated = ARGV[5] ~= ''
if rated then
  local first = redis.call('HGET', KEYS[4], ARGV[5])
  if first then return {2, first} end
end
local status, stream, entry, maxlen, outcome = 1, KEYS[2], ARGV[2], ARGV[3], ARGV[4]
if ARGV[8] == '1' then
  if redis.call('EXISTS', KEYS[7]) == 1 then
    status, entry = 4, ARGV[11]
  elseif tonumber(ARGV[9]) > 0 then
    local n = redis.call('INCR', KEYS[6])
    if n == 1 then redis.call('EXPIRE', KEYS[6], 7200) end
    if n > tonumber(ARGV[9]) then status, entry = 3, ARGV[10] end
  end
  if status ~= 1 then stream, maxlen, outcome = KEYS[3], ARGV[7], ARGV[17] end
end
local id
if maxlen ~= '0' then
  id = redis.call('XADD', stream, 'MAXLEN', '~', maxlen, '*', 'data', entry)
else
  id = redis.call('XADD', stream, '*', 'data', entry)
end
local mark = outcome .. ' ' .. id
redis.call('SET', KEYS[1], mark, 'EX', ARGV[1])
if rated then
  redis.call('HSET', KEYS[4], ARGV[5], mark)
  redis.call('HEXPIRE', KEYS[4], ARGV[6], 'FIELDS', 1, ARGV[5])
  if redis.call('TTL', KEYS[4]) < 0 then redis.call('EXPIRE', KEYS[4], ARGV[6]) end
end
if status ~= 1 then return {status, id} end
for i = 20, #ARGV - 1, 2 do
  redis.call('HINCRBY', KEYS[5], ARGV[i], ARGV[i + 1])
  if ARGV[18] ~= '' then redis.call('HINCRBY', KEYS[10], ARGV[18] .. ARGV[i], ARGV[i + 1]) end
end
if ARGV[18] ~= '' and #ARGV >= 20 then redis.call('EXPIRE', KEYS[10], ARGV[19]) end
local fresh = 0
if ARGV[8] == '1' and ARGV[15] ~= '0' then
  local nu = redis.call('HINCRBY', KEYS[8], 'shown', ARGV[15])
  local au = redis.call('HINCRBY', KEYS[8], 'accepted', ARGV[16])
  local nt = redis.call('HINCRBY', KEYS[9], 'shown', ARGV[15])
  local at = redis.call('HINCRBY', KEYS[9], 'accepted', ARGV[16])
  redis.call('EXPIRE', KEYS[8], ARGV[14])
  redis.call('EXPIRE', KEYS[9], ARGV[14])
  local k, least = tonumber(ARGV[12]), tonumber(ARGV[13])
  local nr = nt - nu
  if k > 0 and nu >= least and nr >= least then
    local p = (at - au) / nr
    local sigma = math.max(math.sqrt(p * (1 - p) / nu), 1 / nu)
    local side = ''
    if au / nu > p + k * sigma then side = 'far above' elseif au / nu < p - k * sigma then side = 'far below' end
    if side ~= '' then
      local why = 'accept rate ' .. au .. '/' .. nu .. ' ' .. side .. ' tenant rest ' .. (at - au) .. '/' .. nr
      if redis.call('SET', KEYS[7], why, 'NX') then
        fresh = 1
        -- an outlier no longer shapes its tenant's baseline (else the honest users would look far from it)
        redis.call('HINCRBY', KEYS[9], 'shown', -nu)
        redis.call('HINCRBY', KEYS[9], 'accepted', -au)
      end
    end
  end
end
return {1, id, fresh}
""")


async def append(conn: Caller, keys: Sequence[str], argv: Sequence[Any]) -> tuple[int, str, bool]:
    """Run ``APPEND`` (layout above); returns (status, entry id or first mark, newly quarantined)."""
    reply = await APPEND.run_piped(conn, keys, argv)
    return int(reply[0]), text(reply[1]), len(reply) > 2 and int(reply[2]) == 1


# --- the trainer's group -----------------------------------------------------------------------------------------
@dataclass
class Entry:
    """One delivered sample: its stream id and its ``data`` field (b"" when the entry has none: undecodable)."""

    sample_id: str
    data: bytes


def _entries(raw: Iterable[Any] | None) -> list[Entry]:
    return [Entry(i, f.get(DATA, b"")) for i, f in entries(raw)]


class SampleStream:
    """The samples stream as the trainer's group consumer ``consumer`` sees it."""

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        lease: Lease,
        consumer: str = DEFAULT_CONSUMER,
        claim_idle_ms: int = 60_000,
    ) -> None:
        self.client = client
        self.lease = lease
        self.keys = keys
        self.consumer = consumer
        self.claim_idle_ms = claim_idle_ms

    def ensure_group(self) -> None:
        """Create the group at the start of the stream (so nothing already waiting is skipped)."""
        try:
            self.client.xgroup_create(self.keys.samples, SAMPLES_GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def claim_abandoned(self) -> set[str]:
        """XAUTOCLAIM entries pending (at any consumer) for longer than the claim timeout; returns the claimed ids.

        Our own idle entries are "claimed" too (a no-op): callers subtract what they already owned.
        """
        claimed: set[str] = set()
        cursor = "0-0"
        while True:
            reply = self.client.xautoclaim(
                self.keys.samples,
                SAMPLES_GROUP,
                self.consumer,
                min_idle_time=self.claim_idle_ms,
                start_id=cursor,
                count=500,
            )
            cursor = text(reply[0])
            claimed.update(e.sample_id for e in _entries(reply[1]))
            if cursor == "0-0":
                return claimed

    def own_pending(self) -> list[Entry]:
        """Every entry delivered to this consumer and not yet acknowledged (id order)."""
        out: list[Entry] = []
        last = "0"
        while True:
            reply = self.client.xreadgroup(SAMPLES_GROUP, self.consumer, {self.keys.samples: last}, count=500)
            if not reply or not reply[0][1]:
                return out
            out.extend(_entries(reply[0][1]))
            last = text(reply[0][1][-1][0])

    def read_new(self, count: int, block_ms: int) -> list[Entry]:
        reply = self.client.xreadgroup(
            SAMPLES_GROUP, self.consumer, {self.keys.samples: ">"}, count=count, block=max(block_ms, 1)
        )
        return _entries(reply[0][1]) if reply else []

    def ack(self, sample_ids: Iterable[str]) -> int:
        """XACK + XDEL, refused (``FencedOut``) unless we still hold the trainer lease."""
        ids = list(sample_ids)
        return self.lease.ack(ids) if ids else 0

    def pending_count(self) -> int:
        info = self.client.xpending(self.keys.samples, SAMPLES_GROUP)
        return int(info["pending"])


# --- readers: backlog (feedback's monitor, `onlinerl status`), tools ------------------------------------------------
def length(client: redis.Redis, keys: Keys) -> int:
    """XLEN: samples not yet acknowledged by a trainer (the backlog)."""
    return int(client.xlen(keys.samples))


async def backlog(client: Any, keys: Keys) -> tuple[int, int]:
    """(XLEN, entries never delivered to group ``trainers``); the lag is the whole stream while no group exists."""
    n = int(await client.xlen(keys.samples))
    try:
        groups = await client.xinfo_groups(keys.samples)
    except ResponseError:  # no such key: nothing to consume
        return n, 0
    for g in groups:
        info = {text(k): v for k, v in g.items()}
        if text(info.get("name", "")) == SAMPLES_GROUP:
            lag = info.get("lag")
            return n, int(lag) if lag is not None else n
    return n, n


def add(client: redis.Redis, keys: Keys, entry: bytes | str, entry_id: str = "*") -> str:
    """XADD one sample as feedback would (benchmarks and tools that feed a trainer without the feedback service);
    ``entry_id`` replays a recorded entry under its original id (bench/replay_samples.py)."""
    return text(client.xadd(keys.samples, {DATA: entry}, id=entry_id))


def read_all(client: redis.Redis, keys: Keys, count: int | None = None, start: str = "-") -> list[tuple[str, Any]]:
    """(id, data) of the stream's entries from ``start`` on, oldest first (benchmarks checking what was appended)."""
    return [(i, f.get(DATA, b"")) for i, f in entries(client.xrange(keys.samples, min=start, count=count))]


# --- `onlinerl forget` (admin) ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class ForgottenSamples:
    """What ``forget_samples`` deleted: samples (and how many of them a trainer had already read but not
    acknowledged: it may still train them into its next version), and idempotency marks (tenant-wide only)."""

    samples: int
    delivered: int
    seen_marks: int


def _owned(tenant: str, user: str | None) -> Callable[[dict], bool]:
    return lambda d: d.get("tenant") == tenant and (user is None or d.get("user_hash") == user)


def forget_samples(client: redis.Redis, keys: Keys, tenant: str, user: str | None) -> ForgottenSamples:
    """XDEL every pending sample of ``tenant`` (of ``user``: its rollout's ``user_hash``) and XACK it for the
    trainers' group, so no trainer reads it again. A sample appended after the scan passed is not deleted. One
    already delivered to a trainer (in the group's pending list) is deleted from the stream, but the trainer may hold
    it in memory: it is counted in ``delivered`` (the next version may still be trained on it)."""
    ids = matching_entries(client, keys.samples, _owned(tenant, user))
    delivered = 0
    if ids:
        try:
            pending = client.xpending_range(keys.samples, SAMPLES_GROUP, min="-", max="+", count=1_000_000)
            held = {text(p["message_id"]) for p in pending}
        except ResponseError:  # no group yet: nobody read anything
            held = set()
        delivered = len(held.intersection(ids))
    deleted = 0
    for i in range(0, len(ids), 500):
        part = ids[i : i + 500]
        deleted += int(client.xdel(keys.samples, *part))
        try:
            client.xack(keys.samples, SAMPLES_GROUP, *part)
        except ResponseError:
            pass
    seen = 0
    if user is None:  # `seen:{tenant}:*` names a completion id, not a user: only a tenant-wide forget removes them
        for key in client.scan_iter(match=keys.seen(tenant, "*"), count=1000):
            seen += int(client.unlink(key))
    return ForgottenSamples(deleted, delivered, seen)


# --- retention (privacy.retention.pendingSamplesSeconds): the trainer's keeper -----------------------------------
def trim_expired(client: redis.Redis, keys: Keys, cutoff_ms: int) -> int:
    """Delete samples appended before ``cutoff_ms`` (unix ms) that no trainer acknowledged (XTRIM MINID, exact) and
    drop them from the group's pending list, so nothing waits for them. Returns how many were deleted."""
    deleted = int(client.xtrim(keys.samples, minid=str(cutoff_ms), approximate=False))
    if deleted:
        try:
            stale = client.xpending_range(keys.samples, SAMPLES_GROUP, min="-", max=f"{cutoff_ms - 1}", count=100_000)
        except ResponseError:
            return deleted
        ids = [text(p["message_id"]) for p in stale]
        for i in range(0, len(ids), 500):
            client.xack(keys.samples, SAMPLES_GROUP, *ids[i : i + 500])
    return deleted
