"""Project policy lines on a locked-down valkey (issue 39): each component reaches a project's line as its own ACL user.

The per-line key families (``contract.PER_LINE`` under ``p:*:``) and the ``lines`` registry give every component the
same rights on a project's line as on the shared one: the trainer registers the line, the reloader reports its
versions, feedback counts an outcome into its stats and per-user ledger (the append script, as ``feedback``), the
rollout controller gates and decides on it (its apply script snapshots the line's stable counters, as ``rollout``).
``ACL LOG`` stays empty. The gateway's and feedback's refusals outside their rights are test_acl*.py's.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from onlinerl.config import ProjectsConfig, RolloutConfig
from onlinerl.dataplane import lines
from onlinerl.keys import Keys
from onlinerl.schemas import PolicyTable
from onlinerl.valkey import EmbeddedValkey, RedisUsers, ensure_users_file
from onlinerl_rollout.lines import LinesController
from tests.projects.test_feedback_lines import JOB, counters, rate, record
from tests.rollout.sim import ArmSimulator, Truth, publish_loaded
from tests.rollout.test_controller import good_eval

K = Keys(JOB)


@pytest.fixture(scope="module")
def vk(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedValkey]:
    tmp = tmp_path_factory.mktemp("lines-acl")
    server = EmbeddedValkey(tmp / "valkey", users=RedisUsers(JOB, ensure_users_file(tmp / "users.yaml"))).start()
    try:
        yield server
    finally:
        server.stop()


def test_every_component_reaches_a_project_line_as_its_own_user(vk: EmbeddedValkey) -> None:
    admin = redis.Redis.from_url(vk.url)
    clients = {u: redis.Redis.from_url(vk.url_for(u), socket_timeout=10) for u in ("trainer", "reloader", "rollout")}
    try:
        admin.acl_log_reset()
        acme = K.for_project("acme")
        assert lines.register(clients["trainer"], K, "acme")
        publish_loaded(clients["reloader"], JOB, 1, "acme")
        # feedback, as its own user, counts an outcome of acme's line on acme's stats and canary ledger
        rate(vk.url_for("feedback"), record("a0", "acme", "acme", 1, "candidate", canary=1), accepted=True)
        assert counters(admin, acme.stats(1, "candidate"))["accepted"] == 1
        admin.delete(acme.stats(1, "candidate"), acme.arm_users(1, "candidate", 1))
        clock = {"now": 1_000_000.0}
        cfg = RolloutConfig(strategy="canary", canary_share=0.5, min_samples=200, min_dwell_seconds=60.0)
        ctl = LinesController(
            clients["rollout"], JOB, cfg, ProjectsConfig(adapters="all"), good_eval, clock=lambda: clock["now"]
        )
        assert [(line, rec.decision) for line, rec in ctl.tick()] == [("acme", "gate_pass")]
        sim = ArmSimulator(admin, JOB, {0: Truth(0.2), 1: Truth(0.4)}, tenant="acme", line="acme")
        final = None
        for _ in range(60):
            sim.serve(100)
            clock["now"] += 10
            final = next((rec for line, rec in ctl.tick() if rec.decision in ("promote", "rollback")), None)
            if final:
                break
        assert final is not None and final.decision == "promote"
        assert PolicyTable.from_redis(admin.hgetall(acme.policy)).stable == 1
        assert admin.acl_log() == []  # nobody was refused anything on a project line
        with pytest.raises(redis.exceptions.NoPermissionError):
            clients["reloader"].sadd(K.lines, "beta")  # only the trainer registers lines
    finally:
        for c in clients.values():
            c.close()
        admin.close()
