"""``onlinerl policy ...`` against a real valkey: pin, rollback (candidate / to a version / to the previous stable),
pause and resume, each recorded in the decisions stream; bad requests fail with a message that says what to do."""

from __future__ import annotations

import json

import pytest

from onlinerl.cli import main
from onlinerl.config import RolloutConfig
from onlinerl.keys import Keys
from onlinerl.rollout import manual
from onlinerl.rollout.store import RolloutStore
from onlinerl.schemas import PolicyTable
from tests.rollout.sim import publish_loaded

JOB = "manual"


@pytest.fixture
def cli(valkey, redis_client, capsys):
    for v in (1, 2, 3):
        publish_loaded(redis_client, JOB, v)

    def run(*args: str) -> tuple[int, str, str]:
        code = main(["policy", "--redis-url", valkey.url, "--job", JOB, *args])
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


def table(r) -> PolicyTable:
    return PolicyTable.from_redis(r.hgetall(Keys(JOB).policy))


def test_pin_unpin_pause_resume(cli, redis_client) -> None:
    assert cli("pin", "2") == (0, "pin: pinned to v2\n", "")
    assert table(redis_client).pinned == 2
    code, _, err = cli("pin", "9")
    assert code == 2 and "version 9 is not loaded in serving (servable: [0, 1, 2, 3])" in err
    assert cli("pin", "9", "--force")[0] == 0 and table(redis_client).pinned == 9
    held = "stable held at v0 (no gate, canary or raise) until `onlinerl policy resume`"
    assert table(redis_client).hold == 0, "a pin holds stable where it was"
    assert cli("unpin")[1] == f"unpin: unpinned (was v9); {held}\n" and table(redis_client).pinned is None
    assert table(redis_client).hold == 0, "unpinning is not a release: resume is"
    assert cli("pause")[0] == 0 and table(redis_client).paused
    assert cli("resume")[1] == "resume: promotion resumed (stable no longer held at v0)\n"
    assert not table(redis_client).paused and table(redis_client).hold is None
    code, out, _ = cli("show")
    shown = json.loads(out)
    assert shown["versions"] == {"1": "loaded", "2": "loaded", "3": "loaded"}
    assert [d["decision"] for d in shown["decisions"]] == ["pin", "pin", "unpin", "pause", "resume"]
    assert all(d["actor"].startswith("cli") for d in shown["decisions"])  # cli:<login name>


def test_rollback_variants(cli, redis_client) -> None:
    store = RolloutStore(redis_client, Keys(JOB))
    redis_client.hset(Keys(JOB).policy, mapping=PolicyTable(stable=2, candidate=3, canary_share=0.1).to_redis())
    # 1. no target, a candidate running: end the canary, keep stable
    assert cli("rollback")[1] == (
        "rollback: manual rollback: v3 rolled back, v2 serves; "
        "stable held at v2 (no gate, canary or raise) until `onlinerl policy resume`\n"
    )
    t = table(redis_client)
    assert (t.stable, t.candidate, t.canary_share, t.hold) == (2, None, 0.0, 2)
    assert store.state(3).state == "rolled_back"
    # 2. no target, no candidate: back to the newest loaded version below stable that was never rolled back
    assert cli("rollback")[0] == 0 and table(redis_client).stable == 1
    assert store.state(2).state == "rolled_back"
    # 3. explicit target
    assert cli("rollback", "0")[0] == 0 and table(redis_client).stable == 0 and table(redis_client).hold == 0
    code, _, err = cli("rollback", "0")
    assert code == 2 and "v0 is already stable and no candidate is running" in err
    assert [d.decision for _, d in store.decisions()] == ["rollback"] * 3


def test_rollback_returns_to_the_stable_a_promotion_replaced(redis_client) -> None:
    """v3 was promoted over v1: rollback goes to v1 (recorded previous_stable), not to v2."""
    from onlinerl.rollout.records import DecisionRecord, RolloutState

    for v in (1, 2, 3):
        publish_loaded(redis_client, JOB, v)
    store = RolloutStore(redis_client, Keys(JOB))
    store.apply(
        DecisionRecord(decision="promote", version=3, stable=1),
        policy={"stable": 3},
        states=[RolloutState(version=3, state="promoted", previous_stable=1)],
    )
    rec = manual.rollback(store)
    assert rec.version == 1 and table(redis_client).stable == 1


def test_apply_spec_from_the_custom_resource(redis_client) -> None:
    publish_loaded(redis_client, JOB, 1)
    store = RolloutStore(redis_client, Keys(JOB))
    recs = manual.apply_spec(store, RolloutConfig(pinned_version=1, paused=True))
    assert [(r.decision, r.actor) for r in recs] == [("pin", "operator"), ("pause", "operator")]
    assert manual.apply_spec(store, RolloutConfig(pinned_version=1, paused=True)) == []  # idempotent
    t = table(redis_client)
    assert t.pinned == 1 and t.paused


def test_no_redis_url_says_what_to_do(capsys, monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("ONLINERL_CONFIG", raising=False)
    monkeypatch.delenv("ONLINERL__REDIS__URL", raising=False)
    monkeypatch.chdir(tmp_path)  # no .onlinerl of a running stack here (`onlinerl policy` would act on it)
    assert main(["policy", "show"]) == 2
    assert "pass --redis-url, or --state DIR" in capsys.readouterr().err


def test_rollback_to_a_version_serving_unloaded_before(cli, redis_client) -> None:
    """Full weights hold one version, LoRA unloads old adapters: both leave a good version ``retired``; it can be
    rolled back to (the reloader loads it again). A failed version cannot, and the message lists what can."""
    from onlinerl.dataplane import versions
    from onlinerl.schemas import PolicyVersionState

    retired = PolicyVersionState(version=1, state="retired", path="/c/v1")
    failed = PolicyVersionState(version=2, state="failed")
    versions.report(redis_client, Keys(JOB), "sim-0", [retired, failed], ttl=3600)  # the replica of `cli`
    redis_client.hset(Keys(JOB).policy, mapping=PolicyTable(stable=3).to_redis())
    code, _, err = cli("rollback", "2")
    assert code == 2 and "version 2 is not loaded in serving (servable: [0, 1, 3])" in err
    assert cli("rollback")[0] == 0, "the previous stable: the newest servable version below 3"
    t = table(redis_client)
    assert (t.stable, t.hold) == (1, 1)
