"""The offline screen's archive (bench/replay_samples.py): every sample a run appended is recovered from valkey's
append-only file, in order, with its stream id, even after the trainer acknowledged and deleted it."""

from __future__ import annotations

import json

import pytest
import redis

from bench.replay_samples import extract, rescored, resp_commands, update_summary
from onlinerl.config import RewardConfig
from onlinerl.keys import Keys
from onlinerl.valkey import EmbeddedValkey


def test_acknowledged_samples_come_back_from_the_aof_in_order(valkey: EmbeddedValkey, redis_client: redis.Redis):
    keys = Keys("screen")
    ids = []
    for i in range(3):
        sample = {"rollout_id": f"r{i}", "reward": 0.75 if i == 1 else -0.25, "accepted": i == 1}
        ids.append(redis_client.xadd(keys.samples, {"data": json.dumps(sample)}).decode())
    redis_client.xadd(keys.audit, {"data": json.dumps({"reason": "duplicate"})})  # another stream: not a sample
    redis_client.xgroup_create(keys.samples, "trainers", id="0")
    redis_client.xreadgroup("trainers", "t", {keys.samples: ">"})
    redis_client.xack(keys.samples, "trainers", ids[0], ids[1])
    redis_client.xdel(keys.samples, ids[0], ids[1])  # what the trainer does after publishing
    assert redis_client.xlen(keys.samples) == 1

    archived = extract(valkey.data_dir / "appendonlydir")

    assert [sid for sid, _ in archived] == ids
    assert [json.loads(data)["rollout_id"] for _, data in archived] == ["r0", "r1", "r2"]
    assert [json.loads(data)["accepted"] for _, data in archived] == [False, True, False]


def test_a_file_that_is_not_an_aof_is_refused_with_its_position():
    with pytest.raises(ValueError, match="not a RESP array at byte 0"):
        list(resp_commands(b"REDIS0011\xfa"))


def test_update_summary_reads_the_trainers_log_with_and_without_the_kl():
    """The screen's summary of the trainer's "update:" lines, both as the KL penalty on and off prints them."""
    log = (
        "x INFO onlinerl.trainer: update: 10 samples, negative-advantage share 0.80, entropy 0.900, approx KL 1.00e-03,"
        " KL to base 2.00e-03, clip fraction 0.100\n"
        "x INFO onlinerl.trainer: update: 2 samples, negative-advantage share 0.00, entropy 0.400, approx KL 4.00e-02,"
        " KL to base off (klCoef 0), clip fraction 0.200\n"
        "x INFO onlinerl.trainer: update: 4 samples, negative-advantage share 0.50, entropy 0.600, approx KL 4.00e-02,"
        " KL to base off (klCoef 0), clip fraction 0.000, running entropy 0.650\n"
    )
    summary = update_summary(log)
    assert summary["steps"] == 3 and summary["samples"] == 16
    assert summary["negative_advantage_share"] == pytest.approx(10 / 16)
    assert (summary["entropy_min"], summary["entropy_max"], summary["clip_fraction_max"]) == (0.4, 0.9, 0.2)
    assert (summary["running_entropy_min"], summary["running_entropy_max"]) == (0.65, 0.65)
    assert summary["kl_to_base_last"] != summary["kl_to_base_last"]  # off: NaN
    assert update_summary("nothing trained") == {"steps": 0}


def test_rescoring_gives_the_recorded_outcomes_another_reward_table():
    accept = {"accepted": True, "shown_text": "  return x\n", "reward": 0.75}
    reject = {"accepted": False, "shown_text": "return y", "reward": -0.25}
    silence = {"accepted": False, "shown_text": "", "reward": 0.0}
    chars, cursor = RewardConfig(preset="chars"), RewardConfig(preset="cursor")
    assert [rescored(s, chars) for s in (accept, reject, silence)] == pytest.approx([0.5 + 8 * 0.0125, -0.25, 0.0])
    assert [rescored(s, cursor) for s in (accept, reject, silence)] == [0.75, -0.25, 0.0]
