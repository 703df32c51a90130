"""The embedded valkey is real, durable, and survives a restart with its data."""

from onlinerl.valkey import DURABLE_SETTINGS


def test_valkey_is_durable_and_restartable(valkey, redis_client):
    cfg = redis_client.config_get("append*")
    for key, value in DURABLE_SETTINGS.items():
        assert cfg[key] == value
    entry_id = redis_client.xadd("s", {"k": "v"})
    valkey.restart()
    import redis

    again = redis.Redis.from_url(valkey.url)
    assert [e[0] for e in again.xrange("s")] == [entry_id]
    again.close()


def test_free_port_stays_out_of_the_ephemeral_range_never_repeats_and_skips_a_taken_port(monkeypatch) -> None:
    """Ports the kernel hands out for bind(0) are taken by whatever connects next; a stack binds its ports a minute
    after picking them (tests/loop/test_kill9.py once failed on exactly that), so picks come from below that range."""
    import socket
    from pathlib import Path

    import pytest

    from onlinerl import valkey

    lo, hi = valkey.port_range()  # this process's slice of FREE_PORT_RANGE (tests/lanes.py)
    assert hi < int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    picked = [valkey.free_port() for _ in range(200)]
    assert len(set(picked)) == 200 and all(lo <= p <= hi for p in picked)

    # a three-port range (below the ephemeral range: nobody else takes them) with its middle port listened on: the
    # other two, once each, then a clear error
    def bindable(port: int) -> bool:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
            return True

    held = next(
        p
        for p in range(lo + 1, hi)
        if not {p - 1, p, p + 1} & valkey._handed_out and all(bindable(q) for q in (p - 1, p, p + 1))
    )
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", held))
        taken.listen()
        monkeypatch.setenv(valkey.PORT_RANGE_ENV, f"{held - 1}-{held + 1}")
        monkeypatch.setattr(valkey, "_handed_out", set())
        assert {valkey.free_port(), valkey.free_port()} == {held - 1, held + 1}
        with pytest.raises(RuntimeError, match="no free loopback port"):
            valkey.free_port()
