"""`onlinerl status` shows the live figures from the same Redis keys the services write."""

import time

from onlinerl.dataplane import versions
from onlinerl.keys import Keys
from onlinerl.loop.status import collect, render
from onlinerl.rollout.manual import pin
from onlinerl.rollout.store import RolloutStore
from onlinerl.schemas import PolicyTable, PolicyVersionState


def test_status_renders_versions_accept_rates_backlog_trainer_and_decisions(redis_client):
    keys = Keys("demo")
    r = redis_client
    r.hset(keys.policy, mapping=PolicyTable(stable=2, updated_at=time.time()).to_redis())
    loaded = [PolicyVersionState(version=v, state="loaded", path=f"/c/v{v}") for v in (1, 2)]
    versions.report(r, keys, "r-0", loaded, ttl=3600)
    r.hset(keys.stats(2, "stable"), mapping={"shown": 40, "accepted": 10, "served": 50})
    r.hset(keys.stats(0, "stable"), mapping={"shown": 20, "accepted": 2, "served": 25})
    r.xadd(keys.samples, {"data": b"{}"})
    r.hset(
        keys.trainer_status,
        mapping={
            "state": "training",
            "step": 7,
            "version": 2,
            "samples_trained": 56,
            "last_checkpoint_at": time.time() - 5,
        },
    )
    r.hset(keys.reloader_status, mapping={"last_version": 2, "last_reload_at": time.time() - 3})
    pin(RolloutStore(r, keys), 1, actor="test", force=True)

    text = render(collect(r, "demo"))
    assert "stable v2" in text and "pinned 1" in text
    assert "v1:loaded  v2:loaded" in text
    assert "live serving replicas (loaded): r-0 [1, 2]" in text
    assert "v2    stable    0.250  (10/40, served 50)" in text
    assert "v0    stable    0.100  (2/20, served 25)" in text
    assert "backlog: 1 unconsumed samples" in text
    assert "step 7" in text and "samples trained 56" in text
    assert "last reload: v2" in text
    assert "pin" in text.split("recent rollout decisions:")[1] and "by test" in text
