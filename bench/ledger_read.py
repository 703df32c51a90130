"""Per-user ledger read (``onlinerl.dataplane.stats.read_users``): the rollout controller's cost per look per arm.

The controller reads both arms' ledgers at every look; a ledger holds a field per user and counter. Compares the
product's read with the previous one (every field decoded to str before it is split), on a real valkey, the same
ledger, interleaved rounds; prints medians and their ratio.

Usage: ``python -m bench.ledger_read [--users 800 5000] [--rounds 200]``
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import redis

from onlinerl.dataplane import stats
from onlinerl.dataplane.codec import pairs, text
from onlinerl.keys import Keys
from onlinerl.rollout.records import COUNTER_FIELDS, ArmStats
from onlinerl.valkey import EmbeddedValkey


def previous_read_users(client: redis.Redis, keys: Keys, version: int, arm: str, canary: int) -> dict:
    """``read_users`` before 2026-12-06: each field decoded, then split."""
    per: dict[str, dict[str, int]] = {}
    for field, value in pairs(client.hgetall(keys.arm_users(version, arm, canary))):
        user, sep, counter = text(field).rpartition(":")
        if sep and user and counter in stats.COUNTERS:
            per.setdefault(user, {})[counter] = int(float(value or 0))
    return {user: ArmStats(**counts) for user, counts in per.items()}


def fill(client: redis.Redis, keys: Keys, users: int) -> None:
    key = keys.arm_users(1, "candidate", 1)
    client.delete(key)
    mapping = {f"{i:016x}:{c}": (i * 7 + j) % 50 for i in range(users) for j, c in enumerate(COUNTER_FIELDS)}
    client.hset(key, mapping=mapping)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--users", type=int, nargs="+", default=[800, 5000])
    ap.add_argument("--rounds", type=int, default=200)
    args = ap.parse_args()
    keys = Keys("bench")
    with tempfile.TemporaryDirectory() as tmp:
        server = EmbeddedValkey(Path(tmp)).start()
        try:
            client = redis.Redis.from_url(server.url)
            for users in args.users:
                fill(client, keys, users)
                now = stats.read_users(client, keys, 1, "candidate", 1)
                assert now == previous_read_users(client, keys, 1, "candidate", 1) and len(now) == users
                timings: dict[str, list[float]] = {"previous": [], "now": []}
                for _ in range(args.rounds):  # interleaved: both see the same machine noise
                    for name, fn in (("previous", previous_read_users), ("now", stats.read_users)):
                        t0 = time.perf_counter()
                        fn(client, keys, 1, "candidate", 1)
                        timings[name].append(time.perf_counter() - t0)
                before, after = (statistics.median(timings[n]) * 1e3 for n in ("previous", "now"))
                print(
                    f"{users} users ({users * len(COUNTER_FIELDS)} fields): previous {before:.2f} ms, "
                    f"now {after:.2f} ms, {before / after:.2f}x (medians of {args.rounds})"
                )
        finally:
            server.stop()


if __name__ == "__main__":
    main()
