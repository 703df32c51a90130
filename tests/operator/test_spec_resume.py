"""A human's rollback holds the rollout until a human releases it: `onlinerl policy resume`, or on Kubernetes the spec
saying so (``spec.rollout.paused`` changed to false). The attack it stops: an operator that writes only ``paused``
would leave a hold nobody on Kubernetes can release without the CLI, and one that cleared the hold on any spec
change would undo the human's rollback. kopf + the real handlers against kmock, a real valkey, the CLI's rollback.
"""

from __future__ import annotations

from typing import Any

import pytest
import redis

from onlinerl.cli import main
from onlinerl.keys import Keys
from onlinerl.rollout.store import RolloutStore
from tests.operator.conftest import Cluster, wait_until
from tests.rollout.sim import publish_loaded

pytestmark = pytest.mark.timeout(240)
JOB = "held"


def spec(url: str, **rollout: Any) -> dict[str, Any]:
    return {"auth": {"allowAnonymous": True}, "redis": {"url": url}, "rollout": rollout}


async def test_the_spec_releases_a_cli_rollback_only_when_paused_turns_false(cluster: Cluster, empty_valkey) -> None:
    r = redis.Redis.from_url(empty_valkey.url)
    store = RolloutStore(r, Keys(JOB))
    try:
        for v in (1, 2):
            publish_loaded(r, JOB, v)
        r.hset(Keys(JOB).policy, mapping={"stable": "2"})
        assert main(["policy", "--redis-url", empty_valkey.url, "--job", JOB, "rollback", "1"]) == 0
        await cluster.apply_job(JOB, spec(empty_valkey.url, paused=True))
        await wait_until(lambda: store.policy().paused, what="paused=1 (spec.rollout.paused)")
        generation = await cluster.patch_spec(JOB, {"serving": {"replicas": 2}})
        await wait_until(lambda: cluster.status(JOB).get("observedGeneration") == generation, 60, what="the change")
        table = store.policy()
        assert (table.stable, table.hold, table.paused) == (1, 1, True), "another spec change released the hold"
        assert table.hold_by.startswith("cli")

        await cluster.patch_spec(JOB, {"rollout": {"paused": False}})
        await wait_until(
            lambda: store.policy().hold is None, 60, what="the hold released by spec.rollout.paused: false"
        )
        assert not store.policy().paused
        last = store.decisions(1)[0][1]
        assert (last.decision, last.actor) == ("resume", "operator")
        assert last.reason == "promotion resumed (stable no longer held at v1)"
    finally:
        r.close()
