"""`onlinerl up` gives each child its own Redis user (issue 35): the gateway and the reloader are two users, the
gateway's cannot write the policy table and feedback's cannot delete the samples stream, on the stack's own valkey
(started by ``start_valkey``, as `onlinerl up` starts it, from the users file in the state folder)."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlparse

import pytest
import redis

from onlinerl.config import OnlineRLConfig
from onlinerl.dataplane.contract import Component
from onlinerl.keys import Keys
from onlinerl.loop.stack import CHILD_USERS, Stack, StackPaths, start_valkey
from onlinerl.valkey import free_port

CHILDREN = ("gateway", "reloader", "feedback", "trainer", "rollout")


@pytest.fixture
def stack(tmp_path: Path):
    cfg = OnlineRLConfig.model_validate({"job": "upjob"})
    paths = StackPaths(tmp_path / "state")
    s = Stack(cfg, paths, valkey=start_valkey(paths, cfg.job, free_port()))
    try:
        yield s
    finally:
        s.stop()


def test_every_child_connects_as_its_own_user(stack: Stack) -> None:
    assert {name: CHILD_USERS[name] for name in CHILDREN} == {
        "gateway": Component.GATEWAY,
        "reloader": Component.RELOADER,
        "feedback": Component.FEEDBACK,
        "trainer": Component.TRAINER,
        "rollout": Component.ROLLOUT,
    }
    users = {name: urlparse(stack.child_env(name)["ONLINERL__REDIS__URL"]).username for name in CHILDREN}
    assert users == {name: CHILD_USERS[name].value for name in CHILDREN}
    assert len({stack.child_env(name)["ONLINERL__REDIS__URL"] for name in CHILDREN}) == len(CHILDREN)


def test_the_stacks_gateway_and_feedback_are_refused_outside_their_rights(stack: Stack) -> None:
    k = Keys("upjob")
    admin = redis.Redis.from_url(stack.valkey.url)
    admin.xadd(k.samples, {"data": "{}"})
    gateway = redis.Redis.from_url(stack.child_env("gateway")["ONLINERL__REDIS__URL"])
    feedback = redis.Redis.from_url(stack.child_env("feedback")["ONLINERL__REDIS__URL"])
    reloader = redis.Redis.from_url(stack.child_env("reloader")["ONLINERL__REDIS__URL"])
    try:
        with pytest.raises(redis.exceptions.NoPermissionError):
            gateway.hset(k.policy, "stable", "9")
        with pytest.raises(redis.exceptions.NoPermissionError):
            feedback.delete(k.samples)
        with pytest.raises(redis.exceptions.NoPermissionError):
            feedback.xtrim(k.samples, maxlen=0)
        assert feedback.xadd(k.samples, {"data": "{}"})
        assert reloader.hset(k.policy, "stable", "1") == 1  # strategy direct's raise is the reloader's
        assert admin.xlen(k.samples) == 2 and admin.hget(k.policy, "stable") == b"1"
    finally:
        for c in (admin, gateway, feedback, reloader):
            c.close()
