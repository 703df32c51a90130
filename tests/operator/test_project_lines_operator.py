"""The operator and the project policy lines (issue 39): Events for every line's rollout decisions, status.projects,
and the shared line's fields and spec.rollout kept to the shared line.

The decisions are written by the data plane's own ``decisions.apply`` (what the rollout controller and `onlinerl policy
--project` call) on a real valkey; the operator runs in kopf against kmock (tests/operator/conftest.py).
"""

from __future__ import annotations

from typing import Any

import pytest
import redis

from onlinerl.config import ProjectsConfig
from onlinerl.dataplane import decisions
from onlinerl.dataplane import lines as dataplane_lines
from onlinerl.keys import Keys
from onlinerl.rollout.records import DecisionRecord
from onlinerl.schemas import PolicyTable
from onlinerl_operator import project_lines
from onlinerl_operator.project_lines import before_ms, pick, stream_id
from onlinerl_operator.reconcile import decision_event
from onlinerl_operator.render import RenderContext
from onlinerl_operator.status import project_lines_status
from tests.operator.conftest import Cluster, wait_until
from tests.operator.test_operator import assert_statuses_valid, base_spec

pytestmark = pytest.mark.timeout(120)
KEYS = Keys("demo")


def decide(r: redis.Redis, line: str, kind: str, version: int, was: int, reason: str, **table: Any) -> str:
    """One decision on ``line`` (taken while v``was`` was stable) through the data plane's atomic apply (table
    update + verdict + record)."""
    rec = DecisionRecord(decision=kind, version=version, stable=was, reason=reason, actor="controller")
    entry = decisions.apply(r, KEYS.for_line(line), rec, policy=table)
    assert entry is not None
    return entry


def events(cluster: Cluster) -> list[dict[str, Any]]:
    return [e.raw for e in cluster.kmock.objects.values() if not e.deleted and e.raw.get("kind") == "Event"]


def rollout_events(cluster: Cluster) -> list[dict[str, Any]]:
    return [e for e in events(cluster) if "Rollout" in e.get("reason", "")]


async def test_project_lines_get_events_and_status_and_never_move_the_shared_lines_fields(
    cluster: Cluster, empty_valkey
) -> None:
    r = redis.Redis.from_url(empty_valkey.url)
    try:
        shared_id = decide(r, "", "promote", 5, 4, "shared canary won", stable=5)
        decide(r, "acme", "promote", 1, 0, "acme canary won", stable=1)
        r.hset(KEYS.for_project("acme").policy, mapping={"candidate": "2", "canary_share": "0.1"})
        # beta is not listed: registered by the trainer under adapters: all, as in production.
        dataplane_lines.register(r, KEYS, "beta")
        decide(r, "beta", "promote", 1, 0, "beta canary won", stable=1)
        decide(r, "beta", "gate_fail", 2, 1, "beta v2 worse on held-out", candidate="")
        r.sadd(KEYS.lines, "bad:name", "x}y")  # hostile registry members: not tenant names, never read as lines
        spec = base_spec(
            empty_valkey.url, projects={"adapters": "all", "listed": ["acme"]}, rollout={"pinnedVersion": 4}
        )
        await cluster.apply_job("demo", spec)

        def both() -> bool:
            projects = cluster.status("demo").get("projects") or {}
            return "acme" in projects and "beta" in projects

        await wait_until(both, what="status.projects with acme and beta")
        status = cluster.status("demo")
        assert status["projects"] == {
            "acme": {
                "stableVersion": 1,
                "candidateVersion": 2,
                "paused": False,
                "lastDecision": "promote v1 by controller: acme canary won",
            },
            "beta": {
                "stableVersion": 1,
                "paused": False,
                "lastDecision": "gate_fail v2 by controller: beta v2 worse on held-out",
            },
        }
        assert status["projectLines"] == 2
        # The shared line's fields are the shared line's own.
        assert status["stableVersion"] == 5 and "candidateVersion" not in status
        assert status["lastDecisionId"] == shared_id
        assert status["lastDecision"] == "promote v5 by controller: shared canary won"
        promoted = cluster.condition("demo", "PolicyPromoted")
        assert promoted["reason"] == "Promoted" and "policy v5 is stable" in promoted["message"]

        await wait_until(lambda: len(rollout_events(cluster)) == 4, what="4 rollout Events")
        by_reason = sorted((e["reason"], e["type"], e["message"]) for e in rollout_events(cluster))
        assert by_reason == [
            (
                "ProjectRolloutGateFail",
                "Warning",
                "project beta: v2 (stable v1) by controller: beta v2 worse on held-out",
            ),
            ("ProjectRolloutPromote", "Normal", "project acme: v1 (stable v0) by controller: acme canary won"),
            ("ProjectRolloutPromote", "Normal", "project beta: v1 (stable v0) by controller: beta canary won"),
            ("RolloutPromote", "Normal", "v5 (stable v4) by controller: shared canary won"),
        ]
        # spec.rollout.pinnedVersion went to the shared line only.
        await wait_until(lambda: r.hget(KEYS.policy, "pinned") == b"4", what="shared pinned=4")
        for line in ("acme", "beta"):
            assert r.hget(KEYS.for_project(line).policy, "pinned") in (None, b"")

        # A project line's rollback while the operator runs: its Event and its status entry; the shared fields and
        # the PolicyPromoted condition stay (a leaked decision would turn its reason into RolledBack).
        decide(r, "acme", "rollback", 0, 1, "acme v1 lost its canary", stable=0, candidate="")
        await wait_until(
            lambda: (cluster.status("demo").get("projects") or {}).get("acme", {}).get("stableVersion") == 0,
            what="acme rolled back in status",
        )
        await wait_until(lambda: len(rollout_events(cluster)) == 5, what="the rollback's Event")
        status = cluster.status("demo")
        assert status["projects"]["acme"] == {
            "stableVersion": 0,
            "paused": False,
            "lastDecision": "rollback v0 by controller: acme v1 lost its canary",
        }
        assert status["projects"]["beta"]["lastDecision"].startswith("gate_fail v2")
        assert status["stableVersion"] == 5 and status["lastDecisionId"] == shared_id
        assert status["lastDecision"] == "promote v5 by controller: shared canary won"
        assert cluster.condition("demo", "PolicyPromoted")["reason"] == "Promoted"
        rollback = [e for e in rollout_events(cluster) if e["reason"] == "ProjectRolloutRollback"]
        assert len(rollback) == 1 and rollback[0]["type"] == "Warning"
        assert rollback[0]["message"].startswith("project acme: v0 (stable v1)")
        assert r.hget(KEYS.policy, "stable") == b"5"  # the shared table: untouched by the project's rollback

        # More passes report nothing again (the cursor moved; a repeat would be a 409 by the Event's name anyway).
        passes = len(cluster.status_patches())
        r.hset(KEYS.for_project("beta").policy, "candidate", "3")  # a change so that a pass writes status again
        await wait_until(
            lambda: (cluster.status("demo").get("projects") or {}).get("beta", {}).get("candidateVersion") == 3,
            what="a later pass",
        )
        assert len(cluster.status_patches()) > passes
        posted = [q for q in cluster.kmock if q.method.value == "POST" and q.resource == "v1/events"]
        rollout_posts = [q for q in posted if "Rollout" in (q.data or {}).get("reason", "")]
        assert len({q.data["metadata"]["name"] for q in rollout_posts}) == 5
        assert len(rollout_posts) <= 5 + 2, "project decisions are not posted again pass after pass"
        assert_statuses_valid(cluster)
    finally:
        r.close()


async def test_projects_off_reads_no_line_and_removes_the_summary(cluster: Cluster, empty_valkey) -> None:
    r = redis.Redis.from_url(empty_valkey.url)
    try:
        dataplane_lines.register(r, KEYS, "acme")
        decide(r, "acme", "promote", 1, 0, "acme canary won", stable=1)
        await cluster.apply_job("demo", base_spec(empty_valkey.url, projects={"adapters": "all"}))
        await wait_until(lambda: "acme" in (cluster.status("demo").get("projects") or {}), what="acme shown")
        generation = await cluster.patch_spec("demo", {"projects": {"adapters": "off"}})
        await wait_until(lambda: cluster.status("demo").get("observedGeneration") == generation, what="next spec")
        await wait_until(lambda: not cluster.status("demo").get("projects"), what="status.projects removed")
        status = cluster.status("demo")
        assert "projectLines" not in status and "projectDecisionsAfter" not in status
        decide(r, "acme", "rollback", 0, 1, "while off", stable=0)
        patches = len(cluster.status_patches())
        await cluster.patch_spec("demo", {"serving": {"replicas": 2}})
        await wait_until(lambda: len(cluster.status_patches()) > patches, what="a pass after the decision")
        assert not [e for e in rollout_events(cluster) if "while off" in e["message"]]
        assert_statuses_valid(cluster)
    finally:
        r.close()


# --- pure: which decisions a pass reports, and status.projects -----------------------------------------------------
def rec(kind: str = "promote", version: int = 1) -> DecisionRecord:
    return DecisionRecord(decision=kind, version=version, stable=0, reason="r", actor="controller", at=1.0)


def test_pick_reports_everything_new_and_moves_below_the_snapshots_millisecond() -> None:
    per_line = {"a": [("100-0", rec()), ("105-0", rec())], "b": [("100-0", rec()), ("103-1", rec())]}
    taken, cursor = pick(per_line, after="50-0", snapshot_ms=110)
    assert [(line, i) for line, i, _ in taken] == [("a", "100-0"), ("b", "100-0"), ("b", "103-1"), ("a", "105-0")]
    assert cursor == before_ms(110) and stream_id(cursor) < (110, 0) and stream_id(cursor) > (109, 10**9)


def test_pick_first_sight_reports_only_the_newest() -> None:
    per_line = {"a": [(f"{t}-0", rec()) for t in range(1, 40)], "b": [("20-5", rec())]}
    taken, cursor = pick(per_line, after=None, snapshot_ms=99, cap=5)
    assert [i for _, i, _ in taken] == ["35-0", "36-0", "37-0", "38-0", "39-0"]
    assert cursor == before_ms(99)


def test_pick_stops_at_a_full_lines_last_read_so_nothing_is_skipped() -> None:
    full = [(f"{t}-0", rec()) for t in range(10, 13)]  # it filled its read: it may hold more after 12-0
    taken, cursor = pick(
        {"a": full, "b": [("11-0", rec()), ("30-0", rec())]}, after="1-0", snapshot_ms=99, per_line_limit=3
    )
    assert [(line, i) for line, i, _ in taken] == [("a", "10-0"), ("a", "11-0"), ("b", "11-0"), ("a", "12-0")]
    assert cursor == "12-0"  # b's 30-0 is read again from here next pass


def test_pick_over_the_cap_keeps_every_line_of_the_last_id() -> None:
    per_line = {name: [("7-0", rec())] for name in "abcdef"} | {"g": [("5-0", rec())]}
    taken, cursor = pick(per_line, after="1-0", snapshot_ms=99, cap=3)
    assert [(line, i) for line, i, _ in taken] == [("g", "5-0")] + [(n, "7-0") for n in "abcdef"]
    assert cursor == "7-0"


async def test_read_reports_each_decision_once_over_passes_on_a_real_server(empty_valkey) -> None:
    """60 lines with one decision each and one line with 25 (above the per-line read): passes from an early
    cursor report every decision exactly once, 50 at most per pass, the tables of the first 50 lines by name."""
    import redis.asyncio as aioredis

    sync = redis.Redis.from_url(empty_valkey.url)
    names = [f"p{n:02d}" for n in range(60)]
    try:
        start = before_ms(int(sync.time()[0]) * 1000)
        for n in names:
            dataplane_lines.register(sync, KEYS, n)
            decide(sync, n, "promote", 1, 0, f"{n} won", stable=1)
        for v in range(25):
            decide(sync, "p07", "pin", v + 2, 1, f"pin {v}")
    finally:
        sync.close()
    r = aioredis.from_url(empty_valkey.url)
    try:
        seen: list[tuple[str, str]] = []
        cursor, sizes = start, []
        for _ in range(6):
            view = await project_lines.read(r, "demo", ProjectsConfig(adapters="all"), cursor)
            sizes.append(len(view.decisions))
            ids = [i for _, i, _ in view.decisions]
            # at most MAX_EVENTS, and beyond it only other lines' decisions with the same stream id as the last one
            # in (two streams' XADDs in one millisecond share an id, and the cursor is one exclusive id: pick's doc)
            beyond = ids[project_lines.MAX_EVENTS :]
            assert all(i == ids[project_lines.MAX_EVENTS - 1] for i in beyond), (sizes, ids[-5:])
            seen += [(line, i) for line, i, _ in view.decisions]
            cursor = view.cursor
        assert sorted(set(seen)) == sorted(seen) and len(seen) == 60 + 25, sizes
        assert sizes[-1] == 0
        assert view.names == names and list(view.tables) == names[:50]
        assert view.tables["p07"].pinned is None and view.tables["p00"].stable == 1
        off = await project_lines.read(r, "demo", ProjectsConfig(adapters="off"), cursor)
        assert off.names == [] and off.decisions == [] and off.cursor is None
    finally:
        await r.aclose()


def test_status_projects_shows_the_given_tables_and_removes_the_others() -> None:
    tables = {"acme": PolicyTable(stable=3, candidate=4, canary_share=0.1), "beta": PolicyTable(stable=0)}
    old = {"beta": {"stableVersion": 0, "lastDecision": "gate_fail v1 by controller: worse"}, "gone": {}}
    out = project_lines_status(tables, {"acme": "promote v3 by controller: won"}, old)
    assert out["acme"] == {
        "stableVersion": 3,
        "candidateVersion": 4,
        "pinnedVersion": None,
        "paused": False,
        "lastDecision": "promote v3 by controller: won",
    }
    assert out["beta"]["lastDecision"] == "gate_fail v1 by controller: worse"  # carried until beta decides again
    assert out["gone"] is None  # a JSON merge patch removes it


def test_a_projects_event_name_is_a_valid_object_name_and_tells_projects_apart() -> None:
    from onlinerl.config import from_mapping

    ctx = RenderContext(name="demo", namespace="ns", uid="u", cfg=from_mapping({}))
    a = decision_event(ctx, "Acme_Team", "1700000000000-3", rec("rollback"))
    b = decision_event(ctx, "acme-team", "1700000000000-3", rec("rollback"))
    shared = decision_event(ctx, "", "1700000000000-3", rec("rollback"))
    names = {e["metadata"]["name"] for e in (a, b, shared)}
    assert len(names) == 3
    import re

    assert all(re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*", n) for n in names)
    assert a["reason"] == "ProjectRolloutRollback" and a["type"] == "Warning"
    assert a["message"].startswith("project Acme_Team: v1") and shared["reason"] == "RolloutRollback"


async def test_the_operator_user_reads_every_project_line_on_the_locked_down_redis(tmp_path) -> None:
    """As its own ACL user (the generated users: registry, project tables and decisions, TIME in a MULTI) the
    operator's whole data-plane read runs with ``ACL LOG`` empty."""
    from onlinerl.valkey import EmbeddedValkey, RedisUsers, ensure_users_file
    from onlinerl_operator.observe import read_view

    server = EmbeddedValkey(
        tmp_path / "valkey", users=RedisUsers("demo", ensure_users_file(tmp_path / "users.yaml"))
    ).start()
    admin = redis.Redis.from_url(server.url)
    try:
        dataplane_lines.register(admin, KEYS, "beta")
        decide(admin, "acme", "promote", 1, 0, "acme canary won", stable=1)
        decide(admin, "beta", "gate_fail", 2, 0, "beta worse")
        admin.acl_log_reset()
        projects = ProjectsConfig(adapters="all", listed=["acme"])
        view = await read_view(server.url_for("operator"), "demo", projects=projects)
        assert [(line, d.decision) for line, _, d in view.lines.decisions] == [
            ("acme", "promote"),
            ("beta", "gate_fail"),
        ]
        assert view.lines.tables["acme"].stable == 1 and view.lines.names == ["acme", "beta"]
        again = await read_view(
            server.url_for("operator"), "demo", projects=projects, project_decisions_after=view.lines.cursor
        )
        assert again.lines.decisions == []
        assert admin.acl_log() == []
    finally:
        admin.close()
        server.stop()
