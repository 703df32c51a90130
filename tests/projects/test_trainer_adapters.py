"""One trainer, many adapters (issue 39): the real Trainer on the tiny model, fed through the session valkey's stream.

What each test proves:
- an update of one line moves that line's adapter alone (the other adapters' tensors stay bit-identical); a batch
  interleaving two projects and the shared traffic makes one update per line with exactly that line's samples;
  each line publishes under its own folder with ``line`` in the manifest and announces on its own stream; a sample
  is acknowledged only once its line's checkpoint holds it; a sample claiming another project's line trains its
  tenant's lines only and is counted;
- below ``minSamplesPerHour`` a project trains the shared adapter; at the threshold its line opens, from the shared
  stable version's files (v0: the shared adapter's own seeded start); with ``trainShared`` its samples train both
  lines and leave the stream only after both published;
- a restart gives every project its adapter, version counter and optimizer back; a crash between the two lines of a
  trainShared sample trains it again on the line that lacks it only;
- a manual rollback of one project's line puts that adapter back on the target's weights, the others untouched;
- the loop publishes each line when its own steps make it due, and a stop leaves nothing pending;
- DeepSpeed with per-project adapters is refused before anything is loaded (in process, and by the process: exit 2).
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file

from onlinerl.config import ConfigError, OnlineRLConfig, from_mapping
from onlinerl.dataplane import lines
from onlinerl.keys import SAMPLES_GROUP, Keys
from onlinerl.lines import checkpoint_root
from onlinerl.procs import python_module, wait_for
from onlinerl.schemas import TrainingSample
from onlinerl_trainer.adapters import adapter_key
from onlinerl_trainer.trainer import Trainer
from tests.trainer.conftest import JOB, make_sample, trainer_config, xadd_samples

KEYS = Keys(JOB)


def project_config(tmp_path: Path, url: str, model: Path, trainer: dict[str, Any] | None = None, **projects: Any):
    overrides: dict[str, Any] = {"batchSize": 9, "checkpoint": {"everySteps": 1000}, **(trainer or {})}
    base = trainer_config(tmp_path / "ckpt", url, model, **overrides)
    return from_mapping({**base.dump(), "projects": {"adapters": "listed", "minSamplesPerHour": 0, **projects}})


def sample(i: int, tenant: str, line: str = "", reward: float = 0.75) -> TrainingSample:
    """An accepted completion of ``tenant`` (served by ``line``) with its own tokens (ids < 1000: in any vocab)."""
    prompt = [(7 * i + k) % 900 + 20 for k in range(6)]
    completion = [(11 * i + k) % 900 + 20 for k in range(3)]
    return make_sample(i, prompt, completion, [-2.0] * 3, reward, tenant=tenant).model_copy(update={"line": line})


def snapshot(trainer: Trainer) -> dict[str, dict[str, torch.Tensor]]:
    adapters = trainer.learner.adapters
    return {
        line: {k: p.detach().clone() for k, p in adapters.parameters(adapter_key(line)).items()}
        for line in adapters.lines()
    }


def changed(before: dict[str, dict[str, torch.Tensor]], after: dict[str, dict[str, torch.Tensor]]) -> set[str]:
    """The lines whose adapter differs in any bit."""
    return {line for line in before if any(not torch.equal(before[line][k], after[line][k]) for k in before[line])}


def train(trainer: Trainer, r, rows: list[TrainingSample]) -> list[str]:
    ids = xadd_samples(r, rows)
    entries = trainer.collect()
    assert sorted(e.sample_id for e in entries) == sorted(ids)
    trainer.train_on(entries)
    return ids


def pending(r) -> set[str]:
    return {i.decode() for i, _ in r.xrange(KEYS.samples)}


def counter(trainer: Trainer, name: str) -> float:
    value = trainer.metrics.registry.get_sample_value(name)
    return 0.0 if value is None else value


def test_each_adapter_learns_from_its_own_project_only_and_publishes_on_its_own_line(
    tmp_path, redis_client, empty_valkey, tiny_model_path
):
    r = redis_client
    cfg = project_config(tmp_path, empty_valkey.url, tiny_model_path, listed=["alpha", "beta"])
    trainer = Trainer(cfg, r, tiny_model_path)
    trainer.start()

    # --- interleaved: alpha, beta and gamma (no line of its own) in one batch -> one update per line -----------------
    rows = [sample(i, ("alpha", "beta", "gamma")[i % 3]) for i in range(9)]
    ids = train(trainer, r, rows)
    by_tenant = {
        t: [sid for sid, s in zip(ids, rows, strict=True) if s.tenant == t] for t in ("alpha", "beta", "gamma")
    }
    assert trainer.learner.adapters.lines() == ["", "alpha", "beta"]
    assert {line: s["samples"] for line, s in trainer.last_updates.items()} == {"": 3.0, "alpha": 3.0, "beta": 3.0}
    assert trainer.feed.ledgers["alpha"].open_ids == by_tenant["alpha"]
    assert trainer.feed.ledgers["beta"].open_ids == by_tenant["beta"]
    assert trainer.feed.ledgers[""].open_ids == by_tenant["gamma"]
    engines = trainer.learner.adapters.engines
    owned = {line: {id(p) for p in engines[line].params} for line in engines}
    assert not (owned[""] & owned["alpha"]) and not (owned["alpha"] & owned["beta"]) and not (owned[""] & owned["beta"])

    # --- one project's samples move its adapter alone: the others stay bit-identical ------------------------------
    before = snapshot(trainer)
    more_alpha = train(trainer, r, [sample(100 + i, "alpha") for i in range(3)])
    assert changed(before, snapshot(trainer)) == {"alpha"}
    before = snapshot(trainer)
    more_gamma = train(trainer, r, [sample(200 + i, "gamma") for i in range(3)])
    assert changed(before, snapshot(trainer)) == {""}

    # --- hostile: a beta sample claiming alpha's line, a gamma sample claiming beta's ------------------------------
    before = snapshot(trainer)
    hostile = train(trainer, r, [sample(300, "beta", line="alpha"), sample(301, "gamma", line="beta")])
    assert changed(before, snapshot(trainer)) == {"beta", ""}  # never alpha, never beta for gamma's sample
    assert counter(trainer, "onlinerl_trainer_line_mismatch_samples_total") == 2
    assert hostile[0] in trainer.feed.ledgers["beta"].open_ids and hostile[1] in trainer.feed.ledgers[""].open_ids

    # --- nothing acknowledged before its line's checkpoint ------------------------------------------------------------
    everything = set(ids) | set(more_alpha) | set(more_gamma) | set(hostile)
    assert pending(r) == everything
    assert trainer.publish("alpha") == 1
    alpha_ids = by_tenant["alpha"] + more_alpha
    assert pending(r) == everything - set(alpha_ids)  # alpha's, and only alpha's, left with alpha's v1
    alpha_store = trainer.lines["alpha"].store
    assert alpha_store.root == checkpoint_root(tmp_path / "ckpt", JOB, "alpha")
    manifest = alpha_store.manifest(1)
    assert manifest.line == "alpha" and manifest.parent_version == 0 and manifest.sample_ids == alpha_ids
    assert manifest.contributors == {"alpha": [""]}
    assert alpha_store.verify(1)
    (announced,) = r.xrange(KEYS.for_project("alpha").checkpoints)
    assert announced[1][b"version"] == b"1"
    assert Path(announced[1][b"path"].decode()) == alpha_store.path(1).resolve()
    assert announced[1][b"manifest_sha256"].decode() == alpha_store.manifest_sha256(1)
    assert r.xlen(KEYS.checkpoints) == 0 and r.xlen(KEYS.for_project("beta").checkpoints) == 0
    assert lines.read(r, KEYS) == ["alpha"]  # registered before its first announcement (readers find it there)

    assert trainer.publish() == 1  # every line with something open: shared v1 and beta v1
    assert pending(r) == set() and r.xpending(KEYS.samples, SAMPLES_GROUP)["pending"] == 0
    shared, beta = trainer.store.manifest(1), trainer.lines["beta"].store.manifest(1)
    assert shared.line == "" and shared.sample_ids == by_tenant["gamma"] + more_gamma + [hostile[1]]
    assert beta.line == "beta" and beta.sample_ids == by_tenant["beta"] + [hostile[0]]
    assert [int(f[b"version"]) for _, f in r.xrange(KEYS.checkpoints)] == [1]
    assert lines.read(r, KEYS) == ["alpha", "beta"]
    assert trainer.store.path(1) == tmp_path / "ckpt" / JOB / "v1"  # the shared line's layout is unchanged

    # --- every line's files have the shared layout and hold exactly that line's adapter ------------------------------
    files = {
        line: load_file(str(trainer.lines[line].store.path(1) / "adapter_model.safetensors")) for line in ("", "alpha")
    }
    assert set(files["alpha"]) == set(files[""])
    live = trainer.learner.adapters.parameters(adapter_key("alpha"))
    assert all(torch.equal(files["alpha"][k], live[k].detach()) for k in files["alpha"])
    assert not all(torch.equal(files["alpha"][k], files[""][k]) for k in files["alpha"])
    trainer.close()


def test_a_project_below_its_threshold_trains_shared_then_opens_from_shared_stable(
    tmp_path, redis_client, empty_valkey, tiny_model_path
):
    r = redis_client
    cfg = project_config(
        tmp_path,
        empty_valkey.url,
        tiny_model_path,
        listed=["alpha", "beta", "delta"],
        minSamplesPerHour=3,
        trainShared=True,
    )
    trainer = Trainer(cfg, r, tiny_model_path)
    trainer.start()
    seeded = snapshot(trainer)[""]  # the shared adapter's start: trainer.seed's fresh LoRA

    # v0: a line opened while the shared line has no stable version starts where the shared adapter started
    assert trainer.open_line("delta")
    assert all(torch.equal(t, seeded[k]) for k, t in snapshot(trainer)["delta"].items())

    # below the threshold (2 of 3 in the hour): alpha trains the shared adapter, and has none of its own
    early = train(trainer, r, [sample(1, "alpha"), sample(2, "alpha")])
    assert "alpha" not in trainer.lines and trainer.feed.ledgers[""].open_ids == early
    assert trainer.publish("") == 1
    r.hset(KEYS.policy, mapping={"stable": "1"})
    train(trainer, r, [sample(3, "gamma")])  # the shared adapter moves on past its stable v1

    # shared stable v1 learned from alpha, a listed project: beta's adapter must not start from alpha's code, so it
    # starts below the first version trained on alpha (lineage.py): here the fresh LoRA
    assert trainer.open_line("beta") and trainer.lines["beta"].origin == 0
    v1 = load_file(str(trainer.store.path(1) / "adapter_model.safetensors"))
    now = snapshot(trainer)
    assert all(torch.equal(t, seeded[k]) for k, t in now["beta"].items())
    assert not all(torch.equal(now[""][k], v1[k]) for k in v1)

    # the third alpha sample in the hour opens alpha's line from shared stable v1's files (its own code is alpha's
    # to start from), not from the shared adapter's live weights; with trainShared it trains alpha AND shared
    before = snapshot(trainer)
    (third,) = train(trainer, r, [sample(4, "alpha")])
    assert trainer.lines["alpha"].origin == 1
    after = snapshot(trainer)
    assert changed(before, after) == {""}  # of the lines open before: the shared one (beta and delta untouched)
    assert not all(torch.equal(after["alpha"][k], v1[k]) for k in v1)  # alpha opened at v1 and trained on
    assert set(trainer.last_updates) == {"", "alpha"}
    assert trainer.publish("alpha") == 1
    assert third in pending(r)  # the shared line still holds it open
    assert trainer.lines["alpha"].store.manifest(1).metrics["origin_shared_version"] == 1.0
    assert trainer.publish("") == 2
    assert third not in pending(r) and pending(r) == set()
    assert (
        third in trainer.store.manifest(2).sample_ids and third in trainer.lines["alpha"].store.manifest(1).sample_ids
    )
    assert set(early).isdisjoint(trainer.lines["alpha"].store.manifest(1).sample_ids)
    trainer.close()


def test_a_restart_gives_every_project_its_adapter_version_and_optimizer_back(
    tmp_path, redis_client, empty_valkey, tiny_model_path
):
    r = redis_client
    cfg = project_config(tmp_path, empty_valkey.url, tiny_model_path, listed=["alpha"])
    first = Trainer(cfg, r, tiny_model_path)
    first.start()
    train(first, r, [sample(i, ("alpha", "gamma")[i % 2]) for i in range(6)])
    assert first.publish() == 1 and first.lines["alpha"].version == 1
    weights = snapshot(first)
    with first.learner.on_line("alpha"):
        moments = [s["exp_avg"].clone() for s in first.learner.engine.optimizer.state_dict()["state"].values()]
    # alpha trains on, unpublished, then the process goes away: those samples stay pending
    unpublished = train(first, r, [sample(10, "alpha")])
    first.close()

    second = Trainer(cfg, r, tiny_model_path)
    recovery = second.start()
    assert recovery.replayed == 1 and second.lines["alpha"].version == 1 and second.lines["alpha"].step == 1
    assert changed(weights, snapshot(second)) == set()  # both adapters as published
    with second.learner.on_line("alpha"):
        state = second.learner.engine.optimizer.state_dict()["state"].values()
        assert all(torch.equal(a, s["exp_avg"]) for a, s in zip(moments, state, strict=True))
    entries = second.collect()
    assert [e.sample_id for e in entries] == unpublished  # replayed, trained again on alpha's line
    second.train_on(entries)
    assert set(second.last_updates) == {"alpha"}
    assert second.publish("alpha") == 2
    assert second.lines["alpha"].store.manifest(2).parent_version == 1 and pending(r) == set()
    second.close()


def test_a_crash_between_the_two_lines_of_a_train_shared_sample_retrains_only_the_line_that_lacks_it(
    tmp_path, redis_client, empty_valkey, tiny_model_path
):
    r = redis_client
    cfg = project_config(tmp_path, empty_valkey.url, tiny_model_path, listed=["alpha"], trainShared=True)
    first = Trainer(cfg, r, tiny_model_path)
    first.start()
    (both,) = train(first, r, [sample(1, "alpha")])
    assert set(first.last_updates) == {"", "alpha"}
    assert first.publish("alpha") == 1 and pending(r) == {both}  # alpha's v1 holds it, the shared line not yet
    first.close()  # the process dies before the shared line publishes

    second = Trainer(cfg, r, tiny_model_path)
    recovery = second.start()
    assert (recovery.already_trained, recovery.replayed) == (0, 1)  # not acknowledged: the shared line lacks it
    before = snapshot(second)
    second.train_on(second.collect())
    assert set(second.last_updates) == {""}  # trained again on the shared line only, never twice into alpha
    assert changed(before, snapshot(second)) == {""}
    assert pending(r) == {both}
    assert second.publish() == 1
    assert pending(r) == set() and second.store.manifest(1).sample_ids == [both]
    assert second.lines["alpha"].store.versions() == [1]
    second.close()


def test_a_rollback_of_one_project_rebases_its_adapter_alone(tmp_path, redis_client, empty_valkey, tiny_model_path):
    r = redis_client
    cfg = project_config(tmp_path, empty_valkey.url, tiny_model_path, listed=["alpha", "beta"])
    trainer = Trainer(cfg, r, tiny_model_path)
    trainer.start()
    for rnd in range(2):  # v1 and v2 on every line
        train(trainer, r, [sample(10 * rnd + i, ("alpha", "beta", "gamma")[i % 3]) for i in range(6)])
        trainer.publish()
    assert {n: x.version for n, x in trainer.lines.items()} == {"": 2, "alpha": 2, "beta": 2}
    before = snapshot(trainer)
    r.hset(KEYS.for_project("alpha").policy, mapping={"rollback_to": "1", "rollback_at": repr(time.time())})

    train(trainer, r, [sample(50, "gamma")])  # the next update follows alpha's rollback before it trains
    after = snapshot(trainer)
    assert changed(before, after) == {"alpha", ""}  # alpha went back, shared trained gamma, beta untouched
    v1 = load_file(str(trainer.lines["alpha"].store.path(1) / "adapter_model.safetensors"))
    assert all(torch.equal(after["alpha"][k], v1[k]) for k in v1)
    alpha = trainer.lines["alpha"]
    assert (alpha.version, alpha.rebased_from) == (1, 2) and trainer.version == 2 and trainer.lines["beta"].version == 2
    assert "on v1 since the rollback" in r.hget(KEYS.trainer_status, "rebase@alpha").decode()
    assert r.hget(KEYS.trainer_status, "rebase") is None  # the shared line follows no rollback

    train(trainer, r, [sample(51, "alpha")])
    assert trainer.publish("alpha") == 3
    manifest = alpha.store.manifest(3)
    assert (manifest.parent_version, manifest.rebased_from, manifest.line) == (1, 2, "alpha")
    trainer.close()


def test_the_trainer_loop_publishes_every_line_on_its_own_schedule_and_stops_with_nothing_pending(
    tmp_path, redis_client, empty_valkey, tiny_model_path
):
    """Trainer.run, as the process runs it: every line publishes when its own steps make it due, and a stop
    publishes what any line still holds, so nothing stays pending."""
    r = redis_client
    cfg = project_config(
        tmp_path, empty_valkey.url, tiny_model_path, trainer={"checkpoint": {"everySteps": 2}}, listed=["alpha", "beta"]
    )
    trainer = Trainer(cfg, r, tiny_model_path)
    trainer.start()
    xadd_samples(r, [sample(i, ("alpha", "beta", "gamma")[i % 3]) for i in range(9)])  # one step per line
    xadd_samples(r, [sample(20 + i, "alpha") for i in range(3)])  # alpha's second step: alpha alone is due
    stop = threading.Event()
    loop = threading.Thread(target=trainer.run, args=(stop,), daemon=True)
    loop.start()
    try:
        # alpha's v1 announced and its 6 samples acknowledged; beta's 3 and gamma's 3 wait for their lines' versions
        wait_for(
            lambda: r.xlen(KEYS.for_project("alpha").checkpoints) == 1 and len(pending(r)) == 6, 60, what="alpha's v1"
        )
        assert r.xlen(KEYS.checkpoints) == 0 and r.xlen(KEYS.for_project("beta").checkpoints) == 0
    finally:
        stop.set()
        loop.join(60)
    assert not loop.is_alive()
    assert pending(r) == set() and r.xpending(KEYS.samples, SAMPLES_GROUP)["pending"] == 0
    assert {n: x.version for n, x in trainer.lines.items()} == {"": 1, "alpha": 1, "beta": 1}
    assert r.hget(KEYS.trainer_status, "state") == b"stopped"
    assert r.hget(KEYS.trainer_status, "projects") == b'{"alpha":1,"beta":1}'
    trainer.close()


def test_the_trainer_process_refuses_deepspeed_with_per_project_adapters(tmp_path, empty_valkey, tiny_model_path):
    cfg = project_config(tmp_path, empty_valkey.url, tiny_model_path, trainer={"engine": "deepspeed"}, adapters="all")
    config_file = tmp_path / "trainer.yaml"
    config_file.write_text(yaml.safe_dump(cfg.dump()))
    env = {**os.environ, "ONLINERL_CONFIG": str(config_file), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(python_module("onlinerl_trainer"), env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "projects.adapters is not supported with trainer.engine: deepspeed" in proc.stderr
    assert "projects.adapters='all', trainer.engine='deepspeed'" in proc.stderr  # the values it got
    assert "set trainer.engine: torch" in proc.stderr


def test_deepspeed_with_per_project_adapters_is_refused_before_anything_loads(tmp_path, redis_client, empty_valkey):
    cfg: OnlineRLConfig = project_config(
        tmp_path, empty_valkey.url, tmp_path / "no-model-needed", trainer={"engine": "deepspeed"}, listed=["alpha"]
    )
    with pytest.raises(ConfigError, match=r"not supported with trainer\.engine: deepspeed"):
        Trainer(cfg, redis_client, tmp_path / "no-model-needed")
    assert redis_client.get(KEYS.trainer_lease) is None  # refused before it took the lease
