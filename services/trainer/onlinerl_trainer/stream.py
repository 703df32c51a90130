"""The samples stream, consumed by group ``trainers``: read, recover after a crash, acknowledge after a checkpoint.

Acknowledging is XACK + XDEL in one fenced Lua script (fence.py: refused unless this trainer holds the lease), so ``XLEN
samples`` (the feedback service's backlog) shrinks only when a sample is trained into a durable checkpoint (or
deliberately discarded: invalid, stale-dropped, guard-skipped). The consumer name is stable per job (not per process),
so a restarted trainer finds its own pending entries at once; entries of any other consumer are taken over by XAUTOCLAIM
once idle longer than ``claim_idle_ms``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import redis

from onlinerl.keys import SAMPLES_GROUP, Keys
from onlinerl_trainer.fence import Lease

DEFAULT_CONSUMER = "trainer-0"


@dataclass
class Entry:
    sample_id: str
    fields: dict[bytes, bytes]


def _decode_entries(raw: Iterable) -> list[Entry]:
    out = []
    for entry_id, fields in raw:
        if fields is None:  # deleted while pending
            continue
        sid = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
        out.append(Entry(sid, fields))
    return out


class SampleStream:
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
        except redis.ResponseError as exc:
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
            cursor, entries = reply[0], reply[1]
            claimed.update(e.sample_id for e in _decode_entries(entries))
            if cursor in (b"0-0", "0-0"):
                return claimed

    def own_pending(self) -> list[Entry]:
        """Every entry delivered to this consumer and not yet acknowledged (id order)."""
        out: list[Entry] = []
        last = "0"
        while True:
            reply = self.client.xreadgroup(SAMPLES_GROUP, self.consumer, {self.keys.samples: last}, count=500)
            batch = _decode_entries(reply[0][1]) if reply else []
            if not reply or not reply[0][1]:
                return out
            out.extend(batch)
            last_raw = reply[0][1][-1][0]
            last = last_raw.decode() if isinstance(last_raw, bytes) else last_raw

    def read_new(self, count: int, block_ms: int) -> list[Entry]:
        reply = self.client.xreadgroup(
            SAMPLES_GROUP, self.consumer, {self.keys.samples: ">"}, count=count, block=max(block_ms, 1)
        )
        return _decode_entries(reply[0][1]) if reply else []

    def ack(self, sample_ids: Iterable[str]) -> int:
        """XACK + XDEL, refused (``FencedOut``) unless we still hold the trainer lease."""
        ids = list(sample_ids)
        return self.lease.ack(ids) if ids else 0

    def pending_count(self) -> int:
        info = self.client.xpending(self.keys.samples, SAMPLES_GROUP)
        return int(info["pending"])
