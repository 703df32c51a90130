"""The rollout of every policy line (issue 39) against a real valkey, with simulated users (tests/rollout/sim.py).

Each project's line is judged by the same controller as the shared line, handed that line's keys: its gate, its
canary against what that project is served, its guardrails and statistics. The simulated traffic of each line goes
through the product's own gateway record script and feedback append script, with the project's records naming their
line, so a line's canary counts only its own users' outcomes. Decisions reach the same figures as the single-line
controller tests (tests/rollout/test_controller.py) on the same seeds: the machinery is the same, not a copy.
"""

from __future__ import annotations

import time

import pytest
import redis

from onlinerl.config import ProjectsConfig
from onlinerl.dataplane import lines as dataplane_lines
from onlinerl.dataplane import versions
from onlinerl.keys import Keys
from onlinerl.loop.status import collect, render
from onlinerl.rollout.store import RolloutStore
from onlinerl.schemas import PolicyTable, PolicyVersionState
from onlinerl_rollout.controller import EvalRequest
from onlinerl_rollout.lines import LinesController
from tests.rollout.sim import ArmSimulator, Truth, publish_loaded
from tests.rollout.test_controller import TICK_SECONDS, FakeClock, good_eval, rollout_cfg

JOB = "lines"
K = Keys(JOB)
REQUESTS = 100


def start_line(r: redis.Redis, line: str, versions: tuple[int, ...] = (1,)) -> None:
    """A line with stable v0 and ``versions`` loaded by the simulated replica."""
    r.hset(K.for_line(line).policy, mapping=PolicyTable(stable=0).to_redis())
    for v in versions:
        publish_loaded(r, JOB, v, line)


def table(r: redis.Redis, line: str) -> PolicyTable:
    return PolicyTable.from_redis(r.hgetall(K.for_line(line).policy))


def decisions(r: redis.Redis, line: str) -> list[str]:
    return [d.decision for _, d in RolloutStore(r, K.for_line(line)).decisions(100)]


def line_state(r: redis.Redis, line: str) -> tuple:
    """Everything that says what a line serves and why: its policy table, verdicts, decisions stream, holds."""
    k = K.for_line(line)
    return (r.hgetall(k.policy), r.hgetall(k.rollout), r.xrange(k.decisions), r.hgetall(k.holds))


def test_each_line_is_judged_on_its_own_users_with_the_shared_lines_statistics(redis_client) -> None:
    """Shared line: v1 better (0.36 vs 0.30) -> promoted; acme: v1 worse (0.24) -> rolled back; beta: nothing to
    judge (stable only) -> untouched. The figures are the single-line controller's on the same seed (3202 samples to
    promote, 848 to roll back: test_controller.test_better_candidate_promoted_worse_rolled_back)."""
    r, clock = redis_client, FakeClock()
    for line in ("", "acme"):
        start_line(r, line)
    r.hset(K.for_project("beta").policy, mapping=PolicyTable(stable=0).to_redis())
    beta_before = line_state(r, "beta")
    seen: list[tuple[str, str]] = []
    ctl = LinesController(
        r,
        JOB,
        rollout_cfg(),
        ProjectsConfig(adapters="listed", listed=["acme", "beta"]),
        good_eval,
        clock=clock,
        on_decision=[lambda line, rec: seen.append((line, rec.decision))],
    )
    assert [(line, rec.decision) for line, rec in ctl.tick()] == [("", "gate_pass"), ("acme", "gate_pass")]
    sims = {
        "": ArmSimulator(r, JOB, {0: Truth(0.30), 1: Truth(0.36)}, seed=7),
        "acme": ArmSimulator(r, JOB, {0: Truth(0.30), 1: Truth(0.24)}, seed=7, tenant="acme", line="acme"),
    }
    final: dict[str, object] = {}
    for _ in range(400):
        for line, sim in sims.items():
            if line not in final:
                sim.serve(REQUESTS)
        clock.now += TICK_SECONDS
        for line, rec in ctl.tick():
            if rec.decision in ("promote", "rollback"):
                final[line] = rec
        if len(final) == 2:
            break
    assert (final[""].decision, final[""].figures["samples"]) == ("promote", 3202)  # type: ignore[attr-defined]
    assert (final["acme"].decision, final["acme"].figures["samples"]) == ("rollback", 848)  # type: ignore[attr-defined]
    assert (table(r, "").stable, table(r, "acme").stable) == (1, 0)
    assert table(r, "").candidate is None and table(r, "acme").candidate is None
    # each line's decisions are in its own stream, and the hooks were told which line took them
    assert decisions(r, "")[0] == "gate_pass" and decisions(r, "")[-1] == "promote"
    assert decisions(r, "acme")[0] == "gate_pass" and decisions(r, "acme")[-1] == "rollback"
    assert set(decisions(r, "")) == {"gate_pass", "hold", "promote"}
    assert [d for line, d in seen if line == "acme"] == decisions(r, "acme")
    assert line_state(r, "beta") == beta_before and decisions(r, "beta") == []
    # acme's canary counted acme's users only: its arms hold acme's traffic, the shared arms none of it
    acme_served = sims["acme"].served
    acme = K.for_project("acme")
    counted = sum(int(r.hget(acme.stats(v, a), "served") or 0) for v, a in ((0, "stable"), (1, "candidate")))
    assert counted == acme_served
    shared = sum(int(r.hget(K.stats(v, a), "served") or 0) for v, a in ((0, "stable"), (1, "candidate")))
    assert shared == sims[""].served
    assert ctl.line_metrics.decisions.labels("rollback")._value.get() == 1
    assert ctl.metrics.decisions.labels("promote")._value.get() == 1  # the shared line's series, as before


def test_a_rollback_of_one_project_leaves_the_other_lines_untouched(redis_client, capsys) -> None:
    """`onlinerl policy --project acme rollback` (the real CLI) ends acme's canary and holds acme's line; beta's and
    the shared line's policy tables, verdicts, decisions and holds are byte for byte what they were, and beta's canary
    goes on to its own verdict at the next ticks while acme's held line gates nothing."""
    from onlinerl.cli import main

    r, clock = redis_client, FakeClock()
    for line in ("", "acme", "beta"):
        start_line(r, line)
    ctl = LinesController(
        r, JOB, rollout_cfg(), ProjectsConfig(adapters="listed", listed=["acme", "beta"]), good_eval, clock=clock
    )
    assert {line for line, rec in ctl.tick() if rec.decision == "gate_pass"} == {"", "acme", "beta"}
    before = {line: line_state(r, line) for line in ("", "beta")}
    url = f"redis://{r.connection_pool.connection_kwargs['host']}:{r.connection_pool.connection_kwargs['port']}"
    assert main(["policy", "--redis-url", url, "--job", JOB, "--project", "acme", "rollback"]) == 0
    assert "rollback: manual rollback: v1 rolled back, v0 serves" in capsys.readouterr().out
    acme = table(r, "acme")
    assert (acme.stable, acme.candidate, acme.hold) == (0, None, 0)
    assert decisions(r, "acme") == ["gate_pass", "rollback"]
    assert {line: line_state(r, line) for line in ("", "beta")} == before
    # `onlinerl status` shows each project's line on its own row
    text = render(collect(r, JOB, ["acme", "beta"]))
    assert "project policy lines (2;" in text
    row = {ln.split()[0]: ln for ln in text.splitlines() if ln.startswith(("  acme ", "  beta "))}
    assert "stable v0" in row["acme"] and "held at v0 by cli:" in row["acme"] and "candidate" not in row["acme"]
    assert "last verdict v1 rolled_back" in row["acme"] and "manual rollback" in row["acme"]
    assert "stable v0  candidate v1 (0.50)" in row["beta"] and "loaded v1" in row["beta"] and "held" not in row["beta"]
    # acme's next version (trained on the rollback's lineage) is held, not gated; beta's canary runs to its verdict
    state = PolicyVersionState(version=2, state="loaded", rollback_at=acme.rollback_at)
    versions.report(r, K.for_project("acme"), "sim-0", [state], ttl=3600)
    sim = ArmSimulator(r, JOB, {0: Truth(0.30), 1: Truth(0.24)}, seed=7, tenant="beta", line="beta")
    beta_final = None
    for _ in range(100):
        sim.serve(REQUESTS)
        clock.now += TICK_SECONDS
        for line, rec in ctl.tick():
            assert line != "acme", rec
            if line == "beta" and rec.decision == "rollback":
                beta_final = rec
        if beta_final:
            break
    assert beta_final is not None and beta_final.figures["samples"] == 848
    assert decisions(r, "acme") == ["gate_pass", "rollback"] and table(r, "acme").candidate is None
    assert "held at v0" in RolloutStore(r, K.for_project("acme")).activity()[0]


def test_a_project_lines_gate_is_asked_for_that_line_against_what_the_project_is_served(redis_client) -> None:
    """A project line that promoted nothing yet (stable 0) is served the shared policy, so its first candidate is
    gated against the shared line's stable (held on the shared line meanwhile); once the line has a stable of its
    own, against that. The candidate is held on the project's line during the eval, released after."""
    r, clock = redis_client, FakeClock()
    r.hset(K.policy, mapping=PolicyTable(stable=5).to_redis())
    publish_loaded(r, JOB, 5)
    start_line(r, "acme", (1,))
    asked: list[tuple[str, int, str, int]] = []
    held: list[tuple[set[str], set[str]]] = []

    def evaluator(req: EvalRequest):
        asked.append((req.line, req.candidate, req.baseline_line, req.stable))
        held.append(
            ({f.decode() for f in r.hkeys(K.for_project("acme").holds)}, {f.decode() for f in r.hkeys(K.holds)})
        )
        return good_eval(req)

    projects = ProjectsConfig(adapters="listed", listed=["acme"])
    ctl = LinesController(r, JOB, rollout_cfg(), projects, evaluator, clock=clock)
    [(line, rec)] = ctl.tick()
    assert (line, rec.decision, rec.version, rec.stable) == ("acme", "gate_pass", 1, 0)
    assert rec.reason == "gate passed (vs the shared policy's stable v5)"
    assert rec.figures["baseline"] == "the shared policy's stable v5"
    assert asked == [("acme", 1, "", 5)]
    assert held == [({"1:gate"}, {"5:gate"})]
    assert r.hkeys(K.for_project("acme").holds) == [] and r.hkeys(K.holds) == []  # released after the eval
    assert table(r, "acme").candidate == 1 and table(r, "").candidate is None
    # once acme's line has a stable of its own, its next candidate is gated against it
    r.hset(K.for_project("acme").policy, mapping={"stable": "1", "candidate": "", "canary_share": "0.0"})
    publish_loaded(r, JOB, 2, "acme")
    clock.now += TICK_SECONDS
    [(line, rec)] = ctl.tick()
    assert (line, rec.decision, rec.reason) == ("acme", "gate_pass", "gate passed")
    assert asked[-1] == ("acme", 2, "acme", 1) and held[-1] == ({"1:gate", "2:gate"}, set())


def test_which_lines_are_judged(redis_client) -> None:
    """off: the shared line only. listed: the listed projects, not a registered one that is not listed. all: every
    registered line (the trainer registers a line before its first announce), found again at each tick."""
    r, clock = redis_client, FakeClock()
    for line in ("acme", "gamma"):
        start_line(r, line)
    dataplane_lines.register(r, K, "gamma")

    def gated(projects: ProjectsConfig) -> set[str]:
        ctl = LinesController(r, JOB, rollout_cfg(), projects, good_eval, clock=clock)
        return {line for line, rec in ctl.tick() if rec.decision == "gate_pass"}

    assert gated(ProjectsConfig(adapters="off", listed=["acme"])) == set()
    assert gated(ProjectsConfig(adapters="listed", listed=["acme"])) == {"acme"}
    assert gated(ProjectsConfig(adapters="all")) == {"gamma"}  # registered lines only: acme never was
    # a line registered while the controller runs is judged from its next tick
    ctl = LinesController(r, JOB, rollout_cfg(), ProjectsConfig(adapters="all"), good_eval, clock=clock)
    ctl.tick()
    start_line(r, "delta")
    dataplane_lines.register(r, K, "delta")
    assert [(line, rec.decision) for line, rec in ctl.tick()] == [("delta", "gate_pass")]
    # a hostile registry member (not a tenant name: it could name another line's keys) is ignored
    r.sadd(K.lines, "a:b", "x}y")
    assert ctl.project_lines() == ["delta", "gamma"]


@pytest.mark.parametrize(("idle_lines", "canaries"), [(1000, 100)])
def test_a_tick_over_many_lines_reads_them_in_one_pipeline(redis_client, idle_lines: int, canaries: int) -> None:
    """With many lines, a tick reads every line in one pipeline (2 + replicas HGETALLs per line) and does nothing
    more for a line with nothing to do; a line with a running canary reads its own verdict, counters and ledgers.
    Figures printed for the report (-s)."""
    r, clock = redis_client, FakeClock()
    names = [f"p{i:04d}" for i in range(idle_lines + canaries)]
    pipe = r.pipeline(transaction=False)
    for name in names:
        pipe.sadd(K.lines, name)
        pipe.hset(K.for_project(name).policy, mapping=PolicyTable(stable=0).to_redis())
    pipe.execute()
    publish_loaded(r, JOB, 0)  # one live replica
    ctl = LinesController(r, JOB, rollout_cfg(), ProjectsConfig(adapters="all"), good_eval, clock=clock)
    t0 = time.perf_counter()
    assert ctl.tick() == []
    first = time.perf_counter() - t0
    assert list(r.scan_iter(match=f"{K.prefix}p:*:controller")) == []  # nothing written for lines with nothing to do

    def counted_tick() -> tuple[list, dict[str, int], float]:
        r.config_resetstat()
        t0 = time.perf_counter()
        out = ctl.tick()
        took = time.perf_counter() - t0
        stats = {k.removeprefix("cmdstat_"): v["calls"] for k, v in r.info("commandstats").items()}
        for own in ("config|resetstat", "info"):
            stats.pop(own, None)
        return out, stats, took

    lines = len(names) + 1
    out, stats, idle_tick = counted_tick()
    assert out == [] and stats == {"smembers": 1, "time": 1, "zrangebyscore": 1, "hgetall": lines * 3}, stats
    for name in names[:canaries]:
        publish_loaded(r, JOB, 1, name)
    out, _, gate_tick = counted_tick()
    assert len(out) == canaries and {rec.decision for _, rec in out} == {"gate_pass"}
    out, stats, canary_tick = counted_tick()
    assert out == []
    per_canary = (sum(stats.values()) - 3 - lines * 3) / canaries
    assert per_canary <= 6, stats
    print(
        f"\n{lines} lines, 1 replica: first tick {first * 1000:.0f} ms, idle tick {idle_tick * 1000:.1f} ms "
        f"({lines * 3 + 3} commands in 4 round trips); {canaries} gates {gate_tick * 1000:.0f} ms; "
        f"tick with {canaries} canaries {canary_tick * 1000:.1f} ms ({per_canary:.1f} reads per canary: {stats})"
    )


def test_a_project_line_is_gated_on_its_own_held_out_samples_through_its_own_eval_key(tmp_path) -> None:
    """gate_eval: a project's split (projects/<p>/test.jsonl beside the shared one) where it has one, else the
    shared split; always through an eval key of that project, and the shared line through a key of a tenant without
    a line of its own (a key of a project with its own line would reach that line)."""
    from onlinerl.auth import AuthConfigError, write_keys_file
    from onlinerl_rollout.gate_eval import eval_key, held_out

    shared = tmp_path / "data" / "test.jsonl"
    own = tmp_path / "data" / "projects" / "acme" / "test.jsonl"
    own.parent.mkdir(parents=True)
    shared.write_text("")
    own.write_text("")
    assert held_out(shared, "") == (shared, False)
    assert held_out(shared, "acme") == (own, True)
    assert held_out(shared, "beta") == (shared, False)  # beta has no held-out code of its own yet

    keys = write_keys_file(
        tmp_path / "keys.yaml",
        {
            "acme": ["sk-acme-user", {"key": "sk-acme-eval", "role": "eval"}],
            "beta": ["sk-beta-user"],
            "ops": [{"key": "sk-ops-eval", "role": "eval"}],
        },
    )
    own_line = ProjectsConfig(adapters="listed", listed=["acme", "beta"]).has_own_line
    assert eval_key(str(keys), "acme", own_line) == ("sk-acme-eval", "acme")
    assert eval_key(str(keys), "", own_line) == ("sk-ops-eval", "ops")  # not acme's: that reaches acme's line
    with pytest.raises(AuthConfigError, match="no key with role eval or admin of project 'beta'"):
        eval_key(str(keys), "beta", own_line)  # a user key may not pin, and another project's eval key is not beta's


def test_onlinerl_policy_project_refuses_a_project_without_a_line_and_a_hostile_name(redis_client, capsys) -> None:
    """A typo must not create a policy table that nobody serves, and a name that could reach another line's keys is
    refused before Redis is touched: exit 2 with what to fix, nothing written."""
    from onlinerl.cli import main

    r = redis_client
    start_line(r, "acme")
    dataplane_lines.register(r, K, "acme")
    kw = r.connection_pool.connection_kwargs
    url = f"redis://{kw['host']}:{kw['port']}"
    before = sorted(r.keys("*"))
    assert main(["policy", "--redis-url", url, "--job", JOB, "--project", "acmee", "pin", "0"]) == 2
    err = capsys.readouterr().err
    assert "project 'acmee' has no policy line of its own" in err and "(project lines: ['acme'])" in err
    for hostile in ("acme:x", "a}b", "../acme"):
        assert main(["policy", "--redis-url", url, "--job", JOB, "--project", hostile, "rollback"]) == 2
        assert "not allowed" in capsys.readouterr().err
    assert sorted(r.keys("*")) == before
    # the real line: show prints acme's table, not the shared one
    assert main(["policy", "--redis-url", url, "--job", JOB, "--project", "acme", "show"]) == 0
    assert '"stable": 0' in capsys.readouterr().out


def test_the_gates_requests_pin_a_version_on_the_gated_line() -> None:
    """The evaluator's client pins ``X-OnlineRL-Version`` with ``X-OnlineRL-Line: <project>`` for a project line (the
    gateway refuses another project's line for the key), and sends no line for the shared one."""
    from onlinerl.fim import get_template
    from onlinerl.loop.continue_client import PIN_LINE_HEADER, PIN_VERSION_HEADER, ContinueClient

    def client(line: str) -> ContinueClient:
        return ContinueClient("http://gw/v1", "", "sk-acme-eval", "acme", "m", get_template("qwen"), pin_line=line)

    assert client("acme").headers(3)[PIN_VERSION_HEADER] == "3" and client("acme").headers(3)[PIN_LINE_HEADER] == "acme"
    assert PIN_LINE_HEADER not in client("").headers(3)
    assert PIN_LINE_HEADER not in client("acme").headers(None)  # user traffic: routed by the key, nothing pinned


def test_pin_pause_and_resume_act_on_one_projects_line(redis_client, capsys) -> None:
    """`onlinerl policy --project beta pin|pause|unpin|resume`: beta's table and decisions only; acme's and the
    shared line's stay byte-identical, and beta's line is frozen (no verdict, no gate) until resumed."""
    from onlinerl.cli import main

    r, clock = redis_client, FakeClock()
    for line in ("", "acme", "beta"):
        start_line(r, line)
    ctl = LinesController(
        r, JOB, rollout_cfg(), ProjectsConfig(adapters="listed", listed=["acme", "beta"]), good_eval, clock=clock
    )
    ctl.tick()  # v1 of every line is in its canary
    kw = r.connection_pool.connection_kwargs
    cli = ["policy", "--redis-url", f"redis://{kw['host']}:{kw['port']}", "--job", JOB, "--project", "beta"]
    before = {line: line_state(r, line) for line in ("", "acme")}
    assert main([*cli, "pin", "1"]) == 0 and main([*cli, "pause"]) == 0
    beta = table(r, "beta")
    assert (beta.pinned, beta.hold, beta.paused, beta.candidate) == (1, 0, True, 1)
    assert decisions(r, "beta") == ["gate_pass", "pin", "pause"]
    assert {line: line_state(r, line) for line in ("", "acme")} == before
    publish_loaded(r, JOB, 2, "beta")  # a newer version of beta's: it waits for resume
    clock.now += TICK_SECONDS
    ctl.tick()
    assert decisions(r, "beta") == ["gate_pass", "pin", "pause"]  # frozen: no verdict, no new gate
    assert main([*cli, "unpin"]) == 0 and main([*cli, "resume"]) == 0
    beta = table(r, "beta")
    assert (beta.pinned, beta.hold, beta.paused) == (None, None, False)
    assert {line: line_state(r, line) for line in ("",)} == {"": before[""]}
    capsys.readouterr()
