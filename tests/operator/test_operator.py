"""kopf + the real handlers against kmock (the API), with a real valkey for the policy table: end to end."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest
import redis

from onlinerl.dataplane import versions
from onlinerl.keys import Keys
from onlinerl.schemas import PolicyVersionState
from onlinerl.valkey import free_port
from onlinerl_operator import constants as c
from tests.operator.conftest import Cluster, wait_until
from tests.operator.helpers import status_jsonschema, strip_none

pytestmark = pytest.mark.timeout(240)

CHILDREN = [
    ("ConfigMap", "config"),
    ("PersistentVolumeClaim", "checkpoints"),
    ("Deployment", "serving"),
    ("Service", "serving"),
    ("Deployment", "feedback"),
    ("Service", "feedback"),
    ("Service", "trainer"),
    ("Job", "trainer"),
]


def base_spec(url: str, **sections: Any) -> dict[str, Any]:
    return {"auth": {"allowAnonymous": True}, "redis": {"url": url}, **sections}


def assert_statuses_valid(cluster: Cluster) -> None:
    """Every status the operator wrote fits the CRD's status schema, and none carries kopf's bookkeeping."""
    schema = status_jsonschema()
    patches = cluster.status_patches()
    assert patches
    for status in patches:
        jsonschema.validate(strip_none(status), schema)
        assert not any(k.startswith("kopf") or k in ("spec_changed", "observe") for k in status), status


async def test_create_makes_every_child_owned_and_reports_status(cluster: Cluster, empty_valkey) -> None:
    body = await cluster.apply_job("demo", base_spec(empty_valkey.url))
    uid = body["metadata"]["uid"]
    for kind, suffix in CHILDREN:
        obj = await wait_until(lambda k=kind, s=suffix: cluster.obj(k, f"demo-{s}"), what=f"{kind} demo-{suffix}")
        assert obj["metadata"]["ownerReferences"] == [
            {
                "apiVersion": "onlinerl.dev/v1alpha1",
                "kind": "OnlineRLJob",
                "name": "demo",
                "uid": uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
    assert cluster.obj("Ingress", "demo") is None  # ingress disabled by default
    await wait_until(lambda: cluster.status("demo").get("observedGeneration") == 1, what="observedGeneration 1")
    status = cluster.status("demo")
    assert status["phase"] == "Pending" and cluster.condition("demo", "Ready")["status"] == "False"
    assert status["endpoints"]["completions"] == "http://demo-serving.team-a.svc:8000/v1/completions"
    assert status["redisReachable"] is True and status["stableVersion"] == 0
    # The built-in controllers report readiness: the job turns Running / Ready.
    await cluster.make_ready("demo")
    await wait_until(lambda: cluster.status("demo").get("phase") == "Running", what="phase Running")
    assert cluster.condition("demo", "Ready") | {"lastTransitionTime": None} == {
        "type": "Ready",
        "status": "True",
        "reason": "AllComponentsReady",
        "message": "serving, feedback and trainer are up",
        "observedGeneration": 1,
        "lastTransitionTime": None,
    }
    for ctype in ("ServingReady", "FeedbackReady", "TrainerRunning"):
        assert cluster.condition("demo", ctype)["status"] == "True"
    assert cluster.condition("demo", "Degraded")["status"] == "False"
    assert cluster.condition("demo", "PolicyPromoted")["reason"] == "BaseModel"
    # kopf's own bookkeeping lives in annotations, not in status.
    annotations = cluster.job("demo")["metadata"]["annotations"]
    assert f"{c.KOPF_PREFIX}/last-handled-configuration" in annotations
    assert_statuses_valid(cluster)


async def test_update_patches_children_and_advances_observed_generation(cluster: Cluster, empty_valkey) -> None:
    await cluster.apply_job("demo", base_spec(empty_valkey.url))
    await wait_until(lambda: cluster.status("demo").get("observedGeneration") == 1, what="first reconcile")
    old_hash = cluster.obj("Deployment", "demo-serving")["spec"]["template"]["metadata"]["annotations"][
        c.ANNO_CONFIG_HASH
    ]
    generation = await cluster.patch_spec(
        "demo",
        {
            "serving": {"replicas": 3},
            "feedback": {"maxBacklog": 500},
            "ingress": {"enabled": True, "host": "orl.example.com"},
        },
    )
    assert generation == 2
    await wait_until(lambda: cluster.status("demo").get("observedGeneration") == 2, what="observedGeneration 2")
    serving = cluster.obj("Deployment", "demo-serving")
    assert serving["spec"]["replicas"] == 3
    assert serving["spec"]["template"]["metadata"]["annotations"][c.ANNO_CONFIG_HASH] != old_hash  # pods roll
    assert "maxBacklog: 500" in cluster.obj("ConfigMap", "demo-config")["data"]["onlinerl.yaml"]
    ingress = cluster.obj("Ingress", "demo")
    assert ingress["spec"]["rules"][0]["host"] == "orl.example.com"
    # The trainer Job's template is immutable: a config change replaces it (it resumes from the last checkpoint).
    await wait_until(lambda: cluster.creations("Job", "demo-trainer") == 2, what="trainer Job recreated")
    assert all(cd["observedGeneration"] == 2 for cd in cluster.status("demo")["conditions"])
    # Switching the ingress off removes it again.
    await cluster.patch_spec("demo", {"ingress": {"enabled": False}})
    await wait_until(lambda: cluster.status("demo").get("observedGeneration") == 3, what="observedGeneration 3")
    assert cluster.obj("Ingress", "demo") is None
    assert_statuses_valid(cluster)


async def test_trainer_failure_is_retried_with_backoff_then_failed(cluster: Cluster, empty_valkey) -> None:
    spec = base_spec(empty_valkey.url, trainer={"maxRestarts": 2, "restartBackoffSeconds": 0.3})
    await cluster.apply_job("demo", spec)
    await wait_until(lambda: cluster.obj("Job", "demo-trainer"), what="trainer Job")
    await cluster.make_ready("demo")
    failed = {"conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}], "failed": 3}
    for attempt in (1, 2):
        await cluster.set_status("Job", "demo-trainer", failed)
        await wait_until(
            lambda a=attempt: cluster.status("demo").get("trainerRestarts") == a, what=f"restart {attempt}"
        )
        assert cluster.condition("demo", "TrainerRunning")["reason"] in ("Restarting", "Starting")
        await wait_until(
            lambda a=attempt: cluster.creations("Job", "demo-trainer") == a + 1,
            what=f"Job recreated after backoff ({attempt})",
        )
    # The third failure exhausts trainer.maxRestarts=2: Failed, the failed Job is kept for its logs.
    await cluster.set_status("Job", "demo-trainer", failed)
    await wait_until(lambda: cluster.status("demo").get("phase") == "Failed", what="phase Failed")
    trainer = cluster.condition("demo", "TrainerRunning")
    assert trainer["status"] == "False" and trainer["reason"] == "BackoffLimitExceeded"
    assert "maxRestarts=2" in trainer["message"]
    assert cluster.condition("demo", "Degraded")["status"] == "True"
    assert cluster.condition("demo", "ServingReady")["status"] == "True"  # serving keeps serving
    assert cluster.creations("Job", "demo-trainer") == 3 and cluster.obj("Job", "demo-trainer") is not None
    # A spec change grants a fresh retry budget.
    await cluster.patch_spec("demo", {"trainer": {"maxRestarts": 3}})
    await wait_until(lambda: cluster.creations("Job", "demo-trainer") == 4, what="Job recreated after spec change")
    await wait_until(lambda: cluster.status("demo").get("trainerRestarts") == 0, what="retry budget reset")
    assert_statuses_valid(cluster)


async def test_suspend_stops_training_while_serving_continues(cluster: Cluster, empty_valkey) -> None:
    await cluster.apply_job("demo", base_spec(empty_valkey.url))
    await wait_until(lambda: cluster.obj("Job", "demo-trainer"), what="trainer Job")
    await cluster.make_ready("demo")
    await wait_until(lambda: cluster.status("demo").get("phase") == "Running", what="Running")
    serving_before = cluster.obj("Deployment", "demo-serving")
    await cluster.patch_spec("demo", {"trainer": {"suspend": True}})
    await wait_until(lambda: cluster.obj("Job", "demo-trainer")["spec"]["suspend"] is True, what="Job suspended")
    await wait_until(lambda: cluster.status("demo").get("phase") == "Suspended", what="phase Suspended")
    assert cluster.condition("demo", "TrainerRunning")["reason"] == "Suspended"
    assert cluster.condition("demo", "Ready")["status"] == "True"  # serving and feedback still up
    assert cluster.obj("Deployment", "demo-serving")["spec"] == serving_before["spec"]  # no restart of serving
    assert cluster.creations("Job", "demo-trainer") == 1  # suspended in place, not replaced
    await cluster.patch_spec("demo", {"trainer": {"suspend": False}})
    await wait_until(lambda: cluster.obj("Job", "demo-trainer")["spec"]["suspend"] is False, what="Job resumed")
    await wait_until(lambda: cluster.status("demo").get("phase") == "Running", what="Running again")
    assert cluster.creations("Job", "demo-trainer") == 1
    assert_statuses_valid(cluster)


async def test_pinned_version_goes_to_the_live_policy_table(cluster: Cluster, empty_valkey) -> None:
    r = redis.Redis.from_url(empty_valkey.url)
    keys = Keys("demo")
    try:
        # What the reloader and the gateway/feedback would have written.
        r.hset(
            keys.policy,
            mapping={
                "stable": "2",
                "candidate": "3",
                "canary_share": "0.1",
                "pinned": "",
                "paused": "0",
                "updated_at": "1",
            },
        )
        r.hset(keys.stats(2, "stable"), mapping={"shown": 40, "accepted": 10})
        r.hset(keys.stats(2, "pinned"), mapping={"shown": 10, "accepted": 5})
        r.hset(
            keys.trainer_status,
            mapping={
                "step": 12,
                "version": 3,
                "samples_trained": 96,
                "last_checkpoint_at": 1763632800.0,
                "state": "training",
            },
        )
        # A rollout decision taken before the operator looks: it must become an Event and show in status.
        from onlinerl.rollout.manual import rollback
        from onlinerl.rollout.store import RolloutStore

        versions.report(r, keys, "r-0", [PolicyVersionState(version=1, state="loaded")], ttl=3600)
        rollback(RolloutStore(r, keys), 1, actor="test", force=True)  # v2 -> v1
        r.hset(keys.policy, mapping={"stable": "2", "candidate": "3"})  # as the test set up the table
        await cluster.apply_job("demo", base_spec(empty_valkey.url, rollout={"pinnedVersion": 2, "paused": True}))
        await wait_until(lambda: r.hget(keys.policy, "pinned") == b"2", what="pinned=2 in Redis")
        await wait_until(lambda: r.hget(keys.policy, "paused") == b"1", what="paused=1 in Redis (spec.rollout.paused)")
        policy = r.hgetall(keys.policy)
        assert policy[b"stable"] == b"2" and policy[b"candidate"] == b"3"  # fields the operator does not own
        await wait_until(lambda: cluster.status("demo").get("pinnedVersion") == 2, what="status pinnedVersion")
        status = cluster.status("demo")
        assert status["stableVersion"] == 2 and status["candidateVersion"] == 3
        assert status["acceptRate"] == pytest.approx(15 / 50) and status["shown"] == 50
        assert status["samplesTrained"] == 96 and status["trainerStep"] == 12
        assert status["lastCheckpointTime"] == "2025-11-20T10:00:00Z"
        promoted = cluster.condition("demo", "PolicyPromoted")
        assert promoted["status"] == "True" and promoted["reason"] == "RolledBack"
        assert "rollback v1 by test" in promoted["message"] and status["lastDecision"].startswith("rollback v1")
        events = [e for e in cluster.kmock.objects.values() if not e.deleted and e.raw.get("kind") == "Event"]
        rollouts = [e.raw for e in events if e.raw.get("reason") == "RolloutRollback"]
        assert len(rollouts) == 1 and rollouts[0]["type"] == "Warning"
        assert rollouts[0]["involvedObject"]["name"] == "demo" and "by test" in rollouts[0]["message"]
        # A manual unpin (`onlinerl policy unpin`) sticks: the spec's pin was applied once, when the field changed,
        # and unrelated spec changes do not re-apply it.
        r.hset(keys.policy, "pinned", "")
        generation = await cluster.patch_spec("demo", {"serving": {"replicas": 2}})
        await wait_until(lambda: cluster.status("demo").get("observedGeneration") == generation, what="next pass")
        await wait_until(lambda: "pinnedVersion" not in cluster.status("demo"), what="status shows the manual unpin")
        assert r.hget(keys.policy, "pinned") == b""
        # The spec field changes: applied again.
        await cluster.patch_spec("demo", {"rollout": {"pinnedVersion": 1}})
        # kmock re-delivers the object until kopf's progress annotations settle: the field handler may take a while.
        await wait_until(lambda: r.hget(keys.policy, "pinned") == b"1", what="pin v1 from the spec", timeout=90)
        # Unpin (kubectl patch with null removes the field).
        await cluster.patch_spec("demo", {"rollout": {"pinnedVersion": None}})
        await wait_until(lambda: r.hget(keys.policy, "pinned") == b"", what="pin cleared", timeout=90)
        await wait_until(lambda: "pinnedVersion" not in cluster.status("demo"), what="status unpinned", timeout=30)
        assert r.hget(keys.policy, "stable") == b"2"
        assert_statuses_valid(cluster)
    finally:
        r.close()


async def test_delete_cleans_up_children(cluster: Cluster, empty_valkey) -> None:
    await cluster.apply_job("demo", base_spec(empty_valkey.url, ingress={"enabled": True}))
    for kind, suffix in CHILDREN:
        await wait_until(lambda k=kind, s=suffix: cluster.obj(k, f"demo-{s}"), what=f"{kind} demo-{suffix}")
    await wait_until(lambda: cluster.obj("Ingress", "demo"), what="ingress")
    await wait_until(
        lambda: c.GROUP + "/cleanup" in cluster.job("demo")["metadata"].get("finalizers", []), what="finalizer"
    )
    await cluster.delete_job("demo")
    await wait_until(lambda: cluster.job("demo") is None, what="job gone (finalizer released)")
    for kind, suffix in CHILDREN:
        assert cluster.obj(kind, f"demo-{suffix}") is None, f"{kind} demo-{suffix} left behind"
    assert cluster.obj("Ingress", "demo") is None


async def test_delete_never_touches_an_existing_claim(cluster: Cluster, empty_valkey) -> None:
    user_claim = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "demo-checkpoints", "namespace": "team-a"},
        "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Gi"}}},
    }
    await cluster.kube.create(user_claim)  # the user's own claim, named like ours
    await cluster.apply_job("demo", base_spec(empty_valkey.url, storage={"existingClaim": "demo-checkpoints"}))
    await wait_until(lambda: cluster.status("demo").get("observedGeneration") == 1, what="reconciled")
    assert "ownerReferences" not in cluster.obj("PersistentVolumeClaim", "demo-checkpoints")["metadata"]
    await cluster.delete_job("demo")
    await wait_until(lambda: cluster.job("demo") is None, what="job gone")
    assert cluster.obj("PersistentVolumeClaim", "demo-checkpoints") is not None


async def test_invalid_spec_is_a_condition_not_a_crash_loop(cluster: Cluster, empty_valkey) -> None:
    await cluster.apply_job("demo", base_spec(empty_valkey.url, trainer={"weights": "full"}))
    await wait_until(lambda: cluster.status("demo").get("phase") == "Invalid", what="phase Invalid")
    ready = cluster.condition("demo", "Ready")
    assert ready["status"] == "False" and ready["reason"] == "InvalidSpec"
    assert "trainer.weights and serving.weightsMode must match" in ready["message"]
    assert "(got trainer.weights='full', serving.weightsMode='lora')" in ready["message"]
    assert cluster.obj("Deployment", "demo-serving") is None  # nothing half-deployed
    # Fixing the spec brings the job up.
    await cluster.patch_spec("demo", {"serving": {"weightsMode": "full"}})
    await wait_until(lambda: cluster.obj("Deployment", "demo-serving"), what="serving after the fix")
    await wait_until(lambda: cluster.status("demo").get("phase") == "Pending", what="phase Pending")
    assert_statuses_valid(cluster)


async def test_unreachable_redis_degrades_but_deploys(cluster: Cluster) -> None:
    await cluster.apply_job("demo", base_spec(f"redis://127.0.0.1:{free_port()}/0"))
    await wait_until(lambda: cluster.status("demo").get("observedGeneration") == 1, what="reconciled", timeout=15)
    assert cluster.obj("Deployment", "demo-serving") is not None
    degraded = cluster.condition("demo", "Degraded")
    assert degraded["status"] == "True" and "Redis not reachable" in degraded["message"]
    assert cluster.status("demo")["redisReachable"] is False and cluster.status("demo")["phase"] == "Degraded"
    assert_statuses_valid(cluster)


async def test_rollback_to_from_the_spec_is_applied_once(cluster: Cluster, empty_valkey) -> None:
    """spec.rollout.rollbackTo makes that version stable through the same path as the CLI, exactly once."""
    r = redis.Redis.from_url(empty_valkey.url)
    keys = Keys("demo")
    try:
        r.hset(keys.policy, mapping={"stable": "2", "candidate": "", "canary_share": "0", "pinned": "", "paused": "0"})
        versions.report(r, keys, "r-0", [PolicyVersionState(version=v, state="loaded") for v in (1, 2)], ttl=3600)
        await cluster.apply_job("demo", base_spec(empty_valkey.url, rollout={"rollbackTo": 1}))
        await wait_until(lambda: r.hget(keys.policy, "stable") == b"1", what="stable rolled back to v1")
        await wait_until(lambda: cluster.status("demo").get("appliedRollbackTo") == 1, what="status appliedRollbackTo")
        await wait_until(
            lambda: cluster.condition("demo", "PolicyPromoted").get("reason") == "RolledBack", what="RolledBack"
        )
        events = [e.raw for e in cluster.kmock.objects.values() if not e.deleted and e.raw.get("kind") == "Event"]
        assert [e["reason"] for e in events if e.get("reason", "").startswith("Rollout")] == ["RolloutRollback"]
        # Someone promotes v2 again by hand: the spec's rollback was carried out already and is not repeated.
        r.hset(keys.policy, "stable", "2")
        await cluster.patch_spec("demo", {"serving": {"replicas": 2}})  # a new reconcile pass
        await wait_until(lambda: cluster.status("demo").get("observedGeneration") == 2, what="second pass")
        assert r.hget(keys.policy, "stable") == b"2"
    finally:
        r.close()
