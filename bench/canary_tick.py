"""A canary tick between looks: what the rollout controller's user count costs, before and after counting up to the cap.

Between looks the controller only asks whether a canary has fewer users than a look needs (few_users.py). It used to
read both arms' per-user ledgers whole for that (``stats.read_users``: HGETALL, then parse); it now counts up to
the cap (``stats.count_users``: HSCAN until ``at_most`` users). On a real valkey with ``--users`` users in each arm
(4 counters each; half the users in both arms), interleaved rounds, it reports per tick: the controller's wall
time, valkey-server's own time (INFO commandstats, the time Redis is busy with it and answers nobody else), and the
bytes valkey sends.

Usage: ``python -m bench.canary_tick [--users 800 5000] [--rounds 50] [--cap 10]``
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import redis

from onlinerl.dataplane import stats
from onlinerl.keys import Keys
from onlinerl.rollout.records import ArmStats
from onlinerl.valkey import EmbeddedValkey

CANARY = 7
LEDGERS = [(7, "candidate"), (6, "stable")]


def fill(client: redis.Redis, keys: Keys, users: int) -> None:
    """``users`` users in each arm's ledger with 4 counters each; the second half of the candidate's users are also in
    the stable arm."""
    for arm_index, (version, arm) in enumerate(LEDGERS):
        per_user = {}
        for u in range(users):
            n = 1 + u % 5
            per_user[f"{u + arm_index * users // 2:032x}"] = ArmStats(
                served=n, shown=n, accepted=1, accepted_chars=9 * n
            )
        stats.seed_users(client, keys, version, arm, CANARY, per_user)


def full_read(client: redis.Redis, keys: Keys, cap: int) -> int:
    """Before: both ledgers whole, users counted from them."""
    users: set[str] = set()
    for version, arm in LEDGERS:
        users |= set(stats.read_users(client, keys, version, arm, CANARY))
    return len(users)


def counted(client: redis.Redis, keys: Keys, cap: int) -> int:
    """After: up to the cap."""
    return stats.count_users(client, keys, LEDGERS, CANARY, cap)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--users", type=int, nargs="+", default=[800, 5000])
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--cap", type=int, default=10, help="users a look needs: ceil(1 / rollout.maxUserShare)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="canary-tick-") as tmp, EmbeddedValkey(Path(tmp) / "valkey") as vk:
        client = redis.Redis.from_url(vk.url)
        for users in args.users:
            keys = Keys(f"tick{users}")
            fill(client, keys, users)
            ways = {"before (read whole)": full_read, "after (count to the cap)": counted}
            wall: dict[str, list[float]] = {name: [] for name in ways}
            busy = dict.fromkeys(ways, 0.0)
            sent = dict.fromkeys(ways, 0)
            answers = {}
            for _ in range(args.rounds):  # interleaved: both see the same machine noise
                for name, way in ways.items():
                    client.config_resetstat()
                    out0 = int(client.client_info()["tot-net-out"])
                    t0 = time.perf_counter()
                    answers[name] = way(client, keys, args.cap)
                    wall[name].append(time.perf_counter() - t0)
                    sent[name] += int(client.client_info()["tot-net-out"]) - out0
                    ledger_reads = ("cmdstat_hgetall", "cmdstat_hscan")
                    busy[name] += sum(v["usec"] for k, v in client.info("commandstats").items() if k in ledger_reads)
            print(f"{users} users per arm ({users * 3 // 2} distinct), cap {args.cap}; answers {answers}")
            base = statistics.median(wall["before (read whole)"])
            for name in ways:
                w = statistics.median(wall[name])
                per_round_busy, per_round_kib = busy[name] / args.rounds / 1e3, sent[name] / args.rounds / 1024
                print(
                    f"  {name:26s} controller {w * 1e3:8.2f} ms ({base / w:6.1f}x less than before)  "
                    f"valkey busy {per_round_busy:7.2f} ms  sent {per_round_kib:9.1f} KiB"
                )
        client.close()


if __name__ == "__main__":
    main()
