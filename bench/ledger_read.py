"""Per-user ledger read (``onlinerl.dataplane.stats.users_from_reply``): the rollout controller's cost per look per
arm, past the HGETALL itself (the same for both).

The controller reads both arms' ledgers at every look; a ledger holds a field per user and counter. Compares the
product's parse of the reply with the previous one (every field decoded to str before it is split), on the same
reply as redis-py returns it (bytes to bytes), interleaved rounds; prints medians and their ratio.

Usage: ``python -m bench.ledger_read [--users 800 5000] [--rounds 200]``
"""

from __future__ import annotations

import argparse
import statistics
import time

from onlinerl.dataplane import stats
from onlinerl.dataplane.codec import pairs, text
from onlinerl.rollout.records import COUNTER_FIELDS, ArmStats


def previous_users_from_reply(raw: dict) -> dict[str, ArmStats]:
    """The parse before 2026-12-06: each field decoded, then split."""
    per: dict[str, dict[str, int]] = {}
    for field, value in pairs(raw):
        user, sep, counter = text(field).rpartition(":")
        if sep and user and counter in stats.COUNTERS:
            per.setdefault(user, {})[counter] = int(float(value or 0))
    return {user: ArmStats(**counts) for user, counts in per.items()}


def reply(users: int) -> dict[bytes, bytes]:
    """A ledger's HGETALL reply as redis-py gives it: 16-hex-digit user hashes, every counter, small integers."""
    return {
        f"{i:016x}:{c}".encode(): str((i * 7 + j) % 50).encode()
        for i in range(users)
        for j, c in enumerate(COUNTER_FIELDS)
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--users", type=int, nargs="+", default=[800, 5000])
    ap.add_argument("--rounds", type=int, default=200)
    args = ap.parse_args()
    for users in args.users:
        raw = reply(users)
        now = stats.users_from_reply(raw)
        assert now == previous_users_from_reply(raw) and len(now) == users
        timings: dict[str, list[float]] = {"previous": [], "now": []}
        for _ in range(args.rounds):  # interleaved: both see the same machine noise
            for name, parse in (("previous", previous_users_from_reply), ("now", stats.users_from_reply)):
                t0 = time.perf_counter()
                parse(raw)
                timings[name].append(time.perf_counter() - t0)
        before, after = (statistics.median(timings[n]) * 1e3 for n in ("previous", "now"))
        print(
            f"{users} users ({users * len(COUNTER_FIELDS)} fields): previous {before:.2f} ms, now {after:.2f} ms, "
            f"{before / after:.2f}x (medians of {args.rounds})"
        )


if __name__ == "__main__":
    main()
