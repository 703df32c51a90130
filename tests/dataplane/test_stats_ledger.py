"""The per-user ledger read (``stats.read_users``) on a real valkey: what it keeps, what it skips, what it makes of
odd values; the same answer over RESP2 and RESP3."""

from __future__ import annotations

import redis

from onlinerl.dataplane import stats
from onlinerl.keys import Keys
from onlinerl.rollout.records import ArmStats


def test_read_users_keeps_known_counters_per_user_and_skips_the_rest(empty_valkey) -> None:
    keys = Keys("ledger")
    key = keys.arm_users(3, "candidate", 2)
    fields = {
        "u1:served": 4,
        "u1:shown": 3,
        "u1:accepted": 2,
        "u1:accepted_chars": 41,
        "u:with:colons:shown": 1,  # the user is everything before the last colon
        "u2:shown": "2.0",  # a float-written counter counts as ArmStats.from_mapping counts it
        "u2:unknown_counter": 9,  # not a counter: ignored
        "nocolon": 5,  # no user: ignored
        ":shown": 7,  # empty user: ignored
        "u3:served": "",  # an empty value is 0
        "ü4:served": 1,  # a non-ASCII user survives the bytes path
    }
    for protocol in (2, 3):
        client = redis.Redis.from_url(empty_valkey.url, protocol=protocol)
        try:
            client.delete(key)
            client.hset(key, mapping=fields)
            users = stats.read_users(client, keys, 3, "candidate", 2)
        finally:
            client.close()
        assert users == {
            "u1": ArmStats(served=4, shown=3, accepted=2, accepted_chars=41),
            "u:with:colons": ArmStats(shown=1),
            "u2": ArmStats(shown=2),
            "u3": ArmStats(),
            "ü4": ArmStats(served=1),
        }, protocol


def test_count_users_counts_the_users_read_users_returns_once_across_arms(empty_valkey) -> None:
    """The controller's count between looks agrees with the full read: the same users, a user in both arms once."""
    keys = Keys("ledger-count")
    cand, stable = keys.arm_users(3, "candidate", 3), keys.arm_users(2, "stable", 3)
    for protocol in (2, 3):
        client = redis.Redis.from_url(empty_valkey.url, protocol=protocol)
        try:
            client.delete(cand, stable)
            client.hset(cand, mapping={"u1:served": 1, "u1:shown": 1, "u2:served": 1, "nocolon": 1, "u9:unknown": 1})
            client.hset(stable, mapping={"u2:served": 1, "u3:served": 2, ":shown": 1})
            ledgers = [(3, "candidate"), (2, "stable")]
            full = set(stats.read_users(client, keys, 3, "candidate", 3)) | set(
                stats.read_users(client, keys, 2, "stable", 3)
            )
            assert full == {"u1", "u2", "u3"}
            assert stats.count_users(client, keys, ledgers, 3, at_most=10) == 3, protocol
            assert stats.count_users(client, keys, ledgers, 3, at_most=2) == 2, protocol  # capped
            assert stats.count_users(client, keys, [(4, "candidate")], 3, at_most=10) == 0  # no ledger: none
        finally:
            client.close()


def test_count_users_on_a_crowd_stops_at_the_cap_and_reads_a_fraction_of_the_ledger(empty_valkey) -> None:
    """5,000 users x 4 counters (a hash table, not a listpack): the count stops at the cap, and the bytes Redis sends
    for it are a small fraction of what HGETALL sends for the same ledger (figures from the connection's own net
    counters)."""
    keys = Keys("ledger-crowd")
    key = keys.arm_users(5, "candidate", 5)
    client = redis.Redis.from_url(empty_valkey.url)
    try:
        crowd = {f"{u:032x}": ArmStats(served=1, shown=1, accepted=1, accepted_chars=1) for u in range(5000)}
        stats.seed_users(client, keys, 5, "candidate", 5, crowd)
        assert client.hlen(key) == 20_000  # the seed writes each counter as its own field, as the product's writers

        def sent_to_me() -> int:  # bytes valkey has sent this connection (CLIENT INFO's tot-net-out)
            return int(client.client_info()["tot-net-out"])

        before = sent_to_me()
        assert stats.count_users(client, keys, [(5, "candidate")], 5, at_most=10) == 10
        counted = sent_to_me() - before
        before = sent_to_me()
        assert stats.read_users(client, keys, 5, "candidate", 5) == crowd
        full = sent_to_me() - before
        assert full > 1_000_000 and counted < full / 50, (counted, full)
    finally:
        client.close()
