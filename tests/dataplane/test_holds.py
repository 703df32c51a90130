"""Version holds with one field per holder: the gate's release never drops another evaluation's hold."""

from __future__ import annotations

from onlinerl.dataplane import holds
from onlinerl.keys import Keys

KEYS = Keys("holdjob")


def test_each_holder_releases_only_its_own_hold(redis_client) -> None:
    assert holds.hold(redis_client, KEYS, [0, 4, 5], 60) == [4, 5]  # `onlinerl eval`: no holder name
    assert holds.hold(redis_client, KEYS, [5, 6], 60, holder="gate") == [5, 6]
    assert holds.read(redis_client, KEYS) == {4, 5, 6}
    holds.release(redis_client, KEYS, [5, 6], holder="gate")
    assert holds.read(redis_client, KEYS) == {4, 5}  # eval's hold on v5 survives the gate's release
    holds.release(redis_client, KEYS, [4, 5])
    assert holds.read(redis_client, KEYS) == set()


def test_expired_and_malformed_holds_hold_nothing(redis_client) -> None:
    holds.hold(redis_client, KEYS, [7], -1, holder="gate")  # already expired: a crashed holder
    redis_client.hset(KEYS.holds, mapping={"x:gate": "9e12", "8:gate": "soon", b"\xff": "9e12", "9:gate": "9e12"})
    assert holds.read(redis_client, KEYS) == {9}
