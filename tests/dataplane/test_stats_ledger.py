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
