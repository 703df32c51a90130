"""End to end in one process on the tiny model: samples in the stream -> PPO steps -> published, verified versions.

The synthetic reward mirrors the issue's example: after a fixed code body, completions that end at a newline are
accepted (+0.75), completions that run on (" foo") are rejected (-0.25). Behaviour log-probs are computed with the
current weights each round, as serving would record them.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from onlinerl.keys import SAMPLES_GROUP, Keys
from onlinerl.schemas import CheckpointManifest
from onlinerl_trainer.batching import StreamSample, collate
from onlinerl_trainer.trainer import NonFiniteWeightsError, Trainer
from onlinerl_trainer.update import completion_logprobs

from .conftest import JOB, make_sample, stream_ids, trainer_config, xadd_samples

PROMPTS = [
    "def add(a, b):\n    return a + b\n",
    "import os\nprint(os.getcwd())\n",
    "for i in range(10):\n    total += i\n",
    "class Point:\n    x: int\n",
]
BODY = " result = compute(x)"


@pytest.fixture
def tokens(tiny_model_path: Path):
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    (newline,) = enc("\n")
    (foo,) = enc(" foo")
    return [enc(p) for p in PROMPTS], enc(BODY), newline, foo


def logprobs_now(trainer: Trainer, rows: list[tuple[list[int], list[int]]]) -> list[list[float]]:
    """Per-token log-probs of each completion under the trainer's current weights (what serving would record)."""
    samples = [StreamSample(str(i), make_sample(i, p, c, [0.0] * len(c), 0.0)) for i, (p, c) in enumerate(rows)]
    batch = collate(samples, trainer.tcfg.max_seq_len, trainer.pad_id)
    with torch.no_grad():
        lp = completion_logprobs(trainer.engine, batch).logp
    return [lp[i][batch.completion_mask[i] > 0].tolist() for i in range(len(rows))]


def ending_logprob(trainer: Trainer, prompts, body, token) -> float:
    """Mean over prompts of log p(token | prompt + body): how much the policy wants to end the line there."""
    rows = [(p, [*body, token]) for p in prompts]
    return sum(lps[-1] for lps in logprobs_now(trainer, rows)) / len(rows)


def test_reward_moves_the_policy_and_versions_are_published(
    tmp_path, redis_client, empty_valkey, tiny_model_path, tokens
):
    prompts, body, newline, foo = tokens
    cfg = trainer_config(
        tmp_path / "ckpt",
        empty_valkey.url,
        tiny_model_path,
        checkpoint={"everySteps": 10},
        # The mechanics of learning on a symmetric signal (batch baseline: +0.5 / -0.5): both endings at full
        # weight. How far the product's defaults let a reject push is test_reject_gradient's business.
        algorithm={"learningRate": 1e-2, "baseline": "batch", "negativeWeight": 1.0},
    )
    trainer = Trainer(cfg, redis_client, tiny_model_path)
    trainer.start()
    before_nl, before_foo = (ending_logprob(trainer, prompts, body, t) for t in (newline, foo))

    all_ids: list[str] = []
    for rnd in range(30):
        rows = [(p, [*body, newline]) for p in prompts] + [(p, [*body, foo]) for p in prompts]
        lps = logprobs_now(trainer, rows)
        samples = [
            make_sample(rnd * 8 + i, p, c, lp, 0.75 if c[-1] == newline else -0.25, trainer.version)
            for i, ((p, c), lp) in enumerate(zip(rows, lps, strict=True))
        ]
        all_ids += xadd_samples(redis_client, samples)
        entries = trainer.collect()
        assert len(entries) == 8
        stats = trainer.train_on(entries)
        assert stats is not None and math.isfinite(stats["loss"])
        if trainer.should_publish():
            trainer.publish()

    after_nl, after_foo = (ending_logprob(trainer, prompts, body, t) for t in (newline, foo))
    print(f"log p(newline) {before_nl:.3f} -> {after_nl:.3f}; log p(' foo') {before_foo:.3f} -> {after_foo:.3f}")
    # A random 2-layer model is near-uniform (log(1/49152) = -10.8) and its final RMSNorm bounds how far an attention-
    # only LoRA can move the logits; measured here: +1.03 and -0.50 nats in 30 steps. The rewarded ending at least
    # doubles its probability, the penalised one loses at least a quarter, the gap between them grows 3x.
    assert after_nl - before_nl > math.log(2)
    assert before_foo - after_foo > -math.log(0.75)
    assert (after_nl - after_foo) - (before_nl - before_foo) > math.log(3)

    # --- three versions published, complete, announced; every sample acknowledged and in exactly one manifest ------
    store = trainer.store
    assert store.versions() == [1, 2, 3]
    manifests = [store.manifest(v) for v in (1, 2, 3)]
    assert [m.parent_version for m in manifests] == [0, 1, 2]
    assert [m.step for m in manifests] == [10, 20, 30]
    trained_ids = [sid for m in manifests for sid in m.sample_ids]
    assert sorted(trained_ids, key=lambda s: tuple(map(int, s.split("-")))) == all_ids
    assert all(m.sample_count == 80 and m.kind == "lora" for m in manifests)
    assert manifests[0].sample_id_range == (all_ids[0], all_ids[79])
    assert all(store.verify(v) for v in (1, 2, 3))
    assert set(manifests[2].files) == {"adapter_config.json", "adapter_model.safetensors"}
    assert {"loss", "clip_fraction", "approx_kl", "reward_mean"} <= set(manifests[2].metrics)
    keys = Keys(JOB)
    announced = redis_client.xrange(keys.checkpoints)
    assert [int(f[b"version"]) for _, f in announced] == [1, 2, 3]
    assert announced[-1][1][b"manifest_sha256"].decode() == store.manifest_sha256(3)
    assert Path(announced[-1][1][b"path"].decode()) == store.path(3).resolve()
    assert redis_client.xlen(keys.samples) == 0 and stream_ids(redis_client) == set()
    assert redis_client.xpending(keys.samples, SAMPLES_GROUP)["pending"] == 0
    status = {k.decode(): v.decode() for k, v in redis_client.hgetall(keys.trainer_status).items()}
    assert status["version"] == "3" and status["step"] == "30" and status["samples_trained"] == "240"
    CheckpointManifest.model_validate_json((store.path(3) / "manifest.json").read_text())

    # --- the published adapter, loaded by peft onto a fresh base, reproduces the trainer's log-probs --------------
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    served = PeftModel.from_pretrained(base, store.path(3)).eval()
    ids = torch.tensor([prompts[0] + body + [newline]])
    with torch.no_grad():
        served_lp = torch.log_softmax(served(input_ids=ids).logits[0, -2], -1)[newline]
        trainer.engine.module.eval()
        own_lp = torch.log_softmax(trainer.engine.module(input_ids=ids).logits[0, -2], -1)[newline]
    assert float(served_lp) == pytest.approx(float(own_lp), abs=1e-4)

    # --- metrics reflect the run ---------------------------------------------------------------------------------
    text = trainer.metrics.render().decode()
    assert "onlinerl_trainer_samples_total 240.0" in text
    assert 'onlinerl_trainer_steps_total{line="shared"} 30.0' in text
    assert 'onlinerl_trainer_policy_version{line="shared"} 3.0' in text

    # --- guard: non-finite weights are never published ------------------------------------------------------------
    guarded = [
        make_sample(990 + i, prompts[0], [*body, newline], [-1.0] * (len(body) + 1), r, 3)
        for i, r in [(0, 1.0), (1, 0.0)]
    ]
    xadd_samples(redis_client, guarded)  # two rewards: a batch baseline leaves them non-zero advantages
    assert trainer.train_on(trainer.collect()) is not None
    with torch.no_grad():
        next(p for p in trainer.engine.module.parameters() if p.requires_grad).fill_(float("nan"))
    with pytest.raises(NonFiniteWeightsError):
        trainer.publish()
    assert store.versions() == [1, 2, 3] and redis_client.xlen(keys.checkpoints) == 3
    assert redis_client.xlen(keys.samples) == 2  # the samples stay pending: a restart retrains them from v3
    assert 'onlinerl_trainer_skipped_steps_total{reason="nonfinite_weights"} 1.0' in trainer.metrics.render().decode()
