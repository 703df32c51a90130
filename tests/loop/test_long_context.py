"""A prompt near ``model.maxModelLen``, through the real gateway and feedback service, is trained on its whole context.

Real valkey, real vLLM on CPU (the session's tiny-model engine; the job's gateway and trainer hold maxModelLen 512),
the real gateway and feedback processes; the real
Trainer in this process consumes what feedback produced. Before issue 15 the trainer cut the oldest prompt tokens
whenever trainer.maxSeqLen < prompt + completion; now it trains the row vLLM saw, or drops and counts it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
import redis
import torch
from transformers import AutoTokenizer

from onlinerl.config import OnlineRLConfig
from onlinerl.fim import get_template
from onlinerl.keys import Keys
from onlinerl.loop.continue_client import ContinueClient
from onlinerl.loop.stack import DEMO_TENANT, Stack, StackPaths
from onlinerl.procs import wait_for
from onlinerl.schemas import TrainingSample
from onlinerl.valkey import free_port
from onlinerl_trainer.batching import Batch
from onlinerl_trainer.trainer import Trainer
from tests.engines import SharedEngine
from tests.loop.stacks import start_serving_and_feedback

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MAX_MODEL_LEN = 512
MAX_TOKENS = 8


class SeeingTrainer(Trainer):
    """The real trainer; it also keeps the unpadded input rows each PPO update received (a spy, not a mock)."""

    def _update(self, batch: Batch, advantages: torch.Tensor):
        self.seen = getattr(self, "seen", [])
        for ids, mask in zip(batch.input_ids, batch.attention_mask, strict=True):
            self.seen.append(ids[mask.bool()].tolist())
        return super()._update(batch, advantages)


@pytest.fixture(scope="module")
def stack(tiny_lora_engine: SharedEngine, tmp_path_factory: pytest.TempPathFactory):
    """Valkey + vLLM + gateway + feedback started by the same code as `onlinerl up`; no trainer process."""
    paths = StackPaths(tmp_path_factory.mktemp("longctx"))
    paths.logs.mkdir(parents=True, exist_ok=True)
    cfg = OnlineRLConfig.model_validate(
        {
            "job": "longctx",
            "model": {"fimTemplate": "plain", "maxModelLen": MAX_MODEL_LEN},
            # a floor on the sampling temperature: the tiny random model answers whitespace when greedy
            "serving": {
                "port": free_port(),
                "engineUrl": f"http://127.0.0.1:{free_port()}",
                "explorationTemperature": 1.0,
            },
            "feedback": {"port": free_port()},
            "trainer": {
                "engine": "torch",
                "torchThreads": 1,
                "maxSeqLen": MAX_MODEL_LEN,
                "batchSize": 64,
                "batchTimeoutSeconds": 0.5,
                "algorithm": {"baseline": "none"},  # one accepted sample still has a gradient
            },
        }
    )
    running = start_serving_and_feedback(cfg, paths, tiny_lora_engine)
    try:
        yield running
    finally:
        running.stop()


def _long_prefix(tokenizer, tokens: int, seed: int) -> str:
    """Python source that, rendered by the plain template, is about ``tokens`` tokens long (distinct first line)."""
    lines = [f"# module {seed}: the first line must reach the learner too"]
    i = 0
    while len(tokenizer(get_template("plain").render("\n".join(lines), "\n"))["input_ids"]) < tokens:
        lines.append(f"value_{seed}_{i} = compute({i}, {i * 7 % 13})")
        i += 1
    return "\n".join(lines[:-1]) + "\nresult = "


def _served_samples(stack: Stack, tokenizer, prompt_tokens: int, want: int, seed: int) -> tuple[int, list[str]]:
    """Serve long prompts through the gateway and accept them through feedback until ``want`` samples exist.
    Returns (samples added, prompts served)."""
    cfg = stack.cfg
    client = ContinueClient(
        f"http://127.0.0.1:{cfg.serving.port}/v1",
        f"http://127.0.0.1:{cfg.feedback.port}/api/training/submit",
        stack.api_key,
        DEMO_TENANT,
        cfg.model.served_name,
        get_template("plain"),
        max_tokens=MAX_TOKENS,
    )
    rclient = redis.Redis.from_url(cfg.redis.url)
    samples_key = Keys(cfg.job).samples
    start = rclient.xlen(samples_key)
    prompts: list[str] = []
    seen: list[tuple[str, dict]] = []  # (shown text, feedback reply) of every attempt, for the failure message

    async def run() -> None:
        async with httpx.AsyncClient(timeout=120) as http:
            for attempt in range(12):
                if rclient.xlen(samples_key) - start >= want:
                    return
                prefix = _long_prefix(tokenizer, prompt_tokens, seed * 100 + attempt)
                prompt = client.template.render(prefix, "\n")
                prompts.append(prompt)
                res = await client.complete(http, prompt)
                assert res.status == 200 and not res.error, res.error
                if not res.text.strip():
                    seen.append((res.text, {}))
                    continue
                body = client.outcome(
                    prompt=prompt,
                    prefix=prefix,
                    suffix="\n",
                    filepath="a.py",
                    shown=res.text,
                    accepted=True,
                    latency_ms=res.latency_ms,
                )
                status, reply = await client.post_outcome(http, body)
                assert status == 200, reply
                seen.append((res.text, reply))
                try:
                    wait_for(lambda: rclient.xlen(samples_key) > start, timeout=5, what="the sample")
                except TimeoutError:
                    continue

    asyncio.run(run())
    n = rclient.xlen(samples_key) - start
    rclient.close()
    assert n >= want, f"only {n} samples from served long prompts: {seen}"
    return n, prompts


def _metric(trainer: Trainer, line: str) -> float:
    rows = [r for r in trainer.metrics.render().decode().splitlines() if r.startswith(line + " ")]
    return float(rows[0].split()[-1])


def test_long_served_prompt_is_trained_whole_or_dropped_never_cut(stack: Stack, tmp_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(stack.cfg.model.path)
    rclient = redis.Redis.from_url(stack.cfg.redis.url)
    near_limit = MAX_MODEL_LEN - MAX_TOKENS - 8
    _, prompts = _served_samples(stack, tokenizer, near_limit, want=1, seed=1)

    trainer = SeeingTrainer(stack.cfg, rclient, Path(stack.cfg.model.path))
    trainer.start()
    entries = trainer.collect()
    served = [TrainingSample.from_json(e.data) for e in entries]
    stats = trainer.train_on(entries)
    assert stats is not None and stats["samples"] == len(served)
    longest = max(len(s.prompt_token_ids) for s in served)
    print(f"served prompt tokens {[len(s.prompt_token_ids) for s in served]}, maxModelLen {MAX_MODEL_LEN}")
    assert longest >= near_limit - 16
    # the learner saw, token for token, the context vLLM conditioned on plus the shown completion
    assert sorted(trainer.seen) == sorted(s.prompt_token_ids + s.completion_token_ids for s in served)
    for s in served:  # the served prompt ids are the whole rendered prompt, oldest tokens included
        assert tokenizer.decode(s.prompt_token_ids) in prompts
        assert s.prompt_token_ids == tokenizer(tokenizer.decode(s.prompt_token_ids))["input_ids"]
    assert trainer.publish() == 1

    # A trainer configured for a shorter context than serving (validation forbids it within one job): the same kind
    # of served sample is dropped and counted, never cut.
    short_cfg = stack.cfg.model_copy(deep=True)
    short_cfg.model.max_model_len = short_cfg.trainer.max_seq_len = 256
    short_cfg.storage.checkpoint_dir = str(tmp_path / "short-ckpt")
    n, _ = _served_samples(stack, tokenizer, near_limit, want=1, seed=2)
    short = SeeingTrainer(short_cfg, rclient, Path(stack.cfg.model.path))
    short.start()
    assert short.train_on(short.collect()) is None and not getattr(short, "seen", [])
    assert _metric(short, 'onlinerl_trainer_dropped_samples_total{reason="too_long"}') == n
    assert rclient.xlen(Keys(stack.cfg.job).samples) == 0  # acknowledged, not left to be retried forever
    rclient.close()
