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
