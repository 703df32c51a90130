"""Feedback per policy line (issue 39), on a real valkey: an outcome counts into the stats of the line that served it.

A project's canary is judged on its own users' outcomes only: the feedback service's ``decide`` copies the record's
``line`` into the TrainingSample and the append script bumps that line's ``stats:`` and per-user ledger
(``Keys.for_project(line)``), the shared line's only for records the shared policy served. A record naming a line
that is neither '' nor the rating tenant's own (a bug or a forged record) is audited ``foreign_line``, rated once,
never trained and never counted, on any line. The silence sweeper keeps the same rule.
"""

from __future__ import annotations

import asyncio
import json

import redis
from redis.asyncio import Redis as AsyncRedis

from onlinerl.config import FeedbackConfig, SilenceConfig
from onlinerl.dataplane import rollouts
from onlinerl.keys import Keys
from onlinerl.schemas import CompletionOutcome, RolloutRecord, SamplingParams
from onlinerl_feedback.decide import FOREIGN_LINE, decide
from onlinerl_feedback.pipeliner import Pipeliner
from onlinerl_feedback.store import FeedbackStore
from onlinerl_feedback.sweeper import SilenceSweeper

JOB = "lines-fb"
K = Keys(JOB)
TEXT = "return a + b"


def record(rid: str, tenant: str, line: str, version: int = 1, arm: str = "stable", canary: int | None = None):
    return RolloutRecord(
        rollout_id=rid,
        tenant=tenant,
        arm=arm,
        policy_version=version,
        line=line,
        served_model=f"{JOB}@{line}-v{version}" if line else f"{JOB}-v{version}",
        user_hash=f"u-{tenant}",
        prompt=f"# {rid}\n",
        prompt_token_ids=[1],
        completion=TEXT,
        completion_token_ids=[2],
        behaviour_logprobs=[-1.0],
        sampling=SamplingParams(temperature=1.0),
        canary=canary,
        finished_at=1000.0,
    )


def rate(url: str, rec: RolloutRecord, accepted: bool, completion_id: str = "") -> tuple:
    """The feedback service's decide + append for one outcome by a key of the record's tenant (its join read is the
    record itself); returns (decision, append result)."""
    event = CompletionOutcome(
        completionId=completion_id or f"{rec.rollout_id}-c", accepted=accepted, completion=TEXT, prompt=rec.prompt
    )

    async def go():
        client = AsyncRedis.from_url(url)
        p = Pipeliner(client)
        p.start()
        try:
            store = FeedbackStore(p, p, K, 3600, 1800)
            decision = decide(event, rec.tenant, rec.prompt, [rec], FeedbackConfig())
            return decision, await store.append(event, rec.tenant, rec.prompt, decision, f"u-{rec.tenant}")
        finally:
            await p.close()
            await client.aclose()

    return asyncio.run(go())


def samples(r: redis.Redis) -> list[dict]:
    return [json.loads(f[b"data"]) for _, f in r.xrange(K.samples)]


def counters(r: redis.Redis, key: str) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in r.hgetall(key).items()}


def every_stats_key(r: redis.Redis) -> set[str]:
    """Every arm-stats key and ledger, of every line (the user statistics ``ustats:`` are job-wide, not a line's)."""
    return {k.decode() for m in ("stats:*", "p:*:stats:*") for k in r.scan_iter(match=f"{K.prefix}{m}")}


def test_an_outcome_counts_into_the_line_that_served_it(redis_client, empty_valkey):
    r = redis_client
    acme, beta = K.for_project("acme"), K.for_project("beta")
    # acme's own line (a canary of v2 against its v1), beta on the shared policy
    rate(empty_valkey.url, record("a1", "acme", "acme", 2, "candidate", canary=2), accepted=True)
    rate(empty_valkey.url, record("a2", "acme", "acme", 1, "stable", canary=2), accepted=False)
    rate(empty_valkey.url, record("b1", "beta", "", 1, "stable"), accepted=True)

    assert counters(r, acme.stats(2, "candidate")) == {
        "shown": 1,
        "accepted": 1,
        "shown_chars": len(TEXT),
        "accepted_chars": len(TEXT),
    }
    assert counters(r, acme.stats(1, "stable")) == {"shown": 1, "rejected": 1, "shown_chars": len(TEXT)}
    assert counters(r, K.stats(1, "stable")) == {
        "shown": 1,
        "accepted": 1,
        "shown_chars": len(TEXT),
        "accepted_chars": len(TEXT),
    }
    # the canary's per-user ledger is acme's line's too; nothing of either tenant on beta's line or elsewhere
    assert counters(r, acme.arm_users(2, "candidate", 2))["u-acme:accepted"] == 1
    assert every_stats_key(r) == {
        acme.stats(2, "candidate"),
        acme.stats(1, "stable"),
        acme.arm_users(2, "candidate", 2),
        acme.arm_users(1, "stable", 2),
        K.stats(1, "stable"),
    }
    assert not any(k.startswith(beta.line_prefix) for k in every_stats_key(r))
    # each sample names its line: the trainer trains acme's adapter on acme's samples only
    assert [(s["rollout_id"], s["tenant"], s["line"], s["policy_version"]) for s in samples(r)] == [
        ("a1", "acme", "acme", 2),
        ("a2", "acme", "acme", 1),
        ("b1", "beta", "", 1),
    ]


def test_a_record_naming_another_projects_line_is_never_counted_there(redis_client, empty_valkey):
    """beta's key rates a record (in beta's own records) that claims acme's line: a forgery or a gateway bug. It is
    audited foreign_line, trained on nowhere, counted on no line, and the rollout is rated (a replay is a duplicate)."""
    r = redis_client
    forged = record("f1", "beta", "acme", 1, "candidate", canary=1)
    decision, result = rate(empty_valkey.url, forged, accepted=True)
    assert (decision.status, decision.reason, decision.counters, decision.to_samples) == (
        "rejected",
        FOREIGN_LINE,
        (),
        False,
    )
    assert result.new and not result.limited
    assert every_stats_key(r) == set() and samples(r) == []
    (audit,) = [json.loads(f[b"data"]) for _, f in r.xrange(K.audit)]
    assert (audit["reason"], audit["tenant"], audit["rollout_id"]) == (FOREIGN_LINE, "beta", "f1")
    _, replay = rate(empty_valkey.url, forged, accepted=True, completion_id="f1-again")
    assert not replay.new and replay.reason == "rollout_already_rated"
    assert every_stats_key(r) == set() and samples(r) == []
    # acme's own record of the same shape counts on acme's line: the rule is about whose line, not the line's name
    rate(empty_valkey.url, record("a1", "acme", "acme", 1, "candidate", canary=1), accepted=True)
    assert counters(r, K.for_project("acme").stats(1, "candidate"))["accepted"] == 1


def test_the_silence_sweeper_counts_a_silence_on_the_served_line_and_never_on_a_foreign_one(redis_client, empty_valkey):
    r = redis_client
    silence = SilenceConfig(window_seconds=10.0, tenants={"acme": True, "beta": True})
    own = record("s1", "acme", "acme", 3)
    forged = record("s2", "beta", "acme", 3)
    shared = record("s3", "beta", "", 3)
    for rec in (own, forged, shared):  # the forged record was not written by the gateway: its served count is shared
        keys = K if rec is forged else K.for_line(rec.line)
        r.execute_command(*rollouts.record_command(keys, rec, 1800, 1000, silence_due=True))

    async def sweep():
        client = AsyncRedis.from_url(empty_valkey.url)
        try:
            return await SilenceSweeper(client, K, FeedbackConfig(silence=silence)).sweep(2000.0)
        finally:
            await client.aclose()

    counts = asyncio.run(sweep())
    assert counts.counts == {"trained": 2, "invalid": 1}
    assert r.hget(K.for_project("acme").stats(3, "stable"), "silent") == b"1"
    assert r.hget(K.stats(3, "stable"), "silent") == b"1"  # beta's shared-line silence only
    assert [(s["rollout_id"], s["line"]) for s in samples(r)] == [("s1", "acme"), ("s3", "")]


def test_forget_clears_the_users_ledgers_on_every_line_and_names_the_own_lines_versions(redis_client, empty_valkey):
    """`onlinerl forget` (issue 38) on a tenant with its own adapter line: the user's per-user ledger fields go from
    the project line's canaries too, and the versions of the tenant's own line trained on the user are named (its
    samples train that line: a forget that looked at the shared line only would miss them)."""
    from onlinerl.forget import Who, forget

    r = redis_client
    acme = K.for_project("acme")
    rate(empty_valkey.url, record("a1", "acme", "acme", 2, "candidate", canary=2), accepted=True)
    rate(empty_valkey.url, record("b1", "beta", "", 1, "stable", canary=1), accepted=True)
    assert any(k.startswith("u-acme:") for k in counters(r, acme.arm_users(2, "candidate", 2)))
    r.xadd(acme.checkpoints, {"version": 1, "parent_version": 0, "contributors": '{"acme": ["u-acme"]}'})
    r.xadd(acme.checkpoints, {"version": 2, "parent_version": 1, "contributors": "{}"})
    r.xadd(K.checkpoints, {"version": 1, "parent_version": 0, "contributors": '{"beta": ["u-beta"]}'})
    report = forget(r, K, Who("acme", "u-acme"))
    assert report.deleted["ledger_fields"] >= 1
    assert not any(k.startswith("u-acme:") for k in counters(r, acme.arm_users(2, "candidate", 2)))
    assert counters(r, acme.stats(2, "candidate"))["accepted"] == 1  # the arm totals name no one: they stay
    assert counters(r, K.arm_users(1, "stable", 1))["u-beta:accepted"] == 1  # another tenant's user: untouched
    assert (report.trained_versions, report.descendant_versions) == ([], [])
    assert (report.own_line_trained_versions, report.own_line_descendant_versions) == ([1], [2])


def test_an_unmatched_outcome_never_trains_a_record_of_a_foreign_line() -> None:
    """feedback.trainUnmatched trains an unmatched event on the tenant's newest record: never on one that names
    another project's line (it is the tenant's own records it picks from, and a forged one is skipped)."""
    from onlinerl.tokens import TokenTable

    table = TokenTable((b"", b"return a ", b"+ b"))  # the record's two tokens: "return a " and "+ b"
    cfg = FeedbackConfig(train_unmatched=True)
    two = {"completion_token_ids": [1, 2], "behaviour_logprobs": [-1.0, -1.0], "prompt": "# p\n"}
    forged = record("f1", "beta", "acme").model_copy(update={**two, "created_at": 2.0})
    honest = record("b1", "beta", "").model_copy(update={**two, "created_at": 1.0})
    event = CompletionOutcome(completionId="c", accepted=True, completion="return a - b", prompt="# p\n")
    d = decide(event, "beta", "# p\n", [forged, honest], cfg, table=table)
    assert d.to_samples and d.rates == "b1" and d.line == ""  # the newest is forged: the honest one is trained
    assert json.loads(d.entry)["line"] == "" and json.loads(d.entry)["completion_token_ids"] == [1]
    d = decide(event, "beta", "# p\n", [forged], cfg, table=table)
    assert (d.status, d.to_samples, d.counters) == ("unmatched", False, ())
