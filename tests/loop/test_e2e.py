"""The whole loop on real processes, tiny settings: every hop, end to end.

completion -> rollout record -> feedback -> sample -> PPO step -> checkpoint -> reload -> the next completion is
served by the new version. Real valkey, real vLLM on CPU (the session's tiny-model engine), real gateway, reloader,
feedback and trainer processes started by the same code as `onlinerl up` (the `onlinerl up` command with its own
engine: tests/loop/test_up_safe_defaults.py).
"""

from __future__ import annotations

import asyncio
import dataclasses

import httpx
import pytest
import redis
from safetensors import safe_open

from onlinerl.config import OnlineRLConfig
from onlinerl.fim import get_template
from onlinerl.keys import Keys
from onlinerl.loop.continue_client import ContinueClient
from onlinerl.loop.stack import DEMO_TENANT, LocalPorts, ensure_demo_key, start_stack
from onlinerl.procs import wait_for
from onlinerl.schemas import PolicyTable
from onlinerl.valkey import free_port
from tests.engines import released

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPTS = [
    ("def add(a, b):\n    return ", "\n"),
    ("import os\nx = os.path.", "\n"),
    ("for i in range(", "):\n    pass\n"),
    ("class A:\n    def __init__(self):\n        self.", "\n"),
    ("y = [1, 2, 3]\nz = len(", ")\n"),
    ("print(", ")\n"),
    ("value = dict(", ")\n"),
    ("if x is None:\n    x = ", "\n"),
]


@pytest.fixture(scope="module")
def stack(tiny_lora_engine, tmp_path_factory):
    state = tmp_path_factory.mktemp("stack")
    cfg = OnlineRLConfig.model_validate(
        {
            "job": "e2e",
            "model": {"path": str(tiny_lora_engine.model_path), "fimTemplate": "plain", "maxModelLen": 1024},
            "serving": {"port": free_port(), "engineUrl": tiny_lora_engine.url},
            "feedback": {"port": free_port()},
            # every hop incl. the reload to stable; the canary end to end: tests/rollout/test_e2e_real.py
            "rollout": {"strategy": "direct"},
            "trainer": {
                "metricsPort": free_port(),
                "batchSize": 2,
                "microBatchSize": 2,
                "batchTimeoutSeconds": 2,
                "engine": "torch",
                "torchThreads": 1,
                "checkpoint": {"everySteps": 1},
                "lora": {"lastLayers": 1},  # an adapter on the last layer only: vLLM must load it as it is
            },
        }
    )
    ports = LocalPorts(redis=free_port(), reloader=free_port(), rollout=free_port())
    with released(tiny_lora_engine, cfg.job):
        running = start_stack(cfg, state, build_data=False, ports=ports, external_engine=True)
        try:
            yield running
        finally:
            running.stop()


def test_every_hop_end_to_end(stack):
    cfg = stack.cfg
    r = redis.Redis.from_url(cfg.redis.url)
    keys = Keys(cfg.job)
    client = ContinueClient(
        f"http://127.0.0.1:{cfg.serving.port}/v1",
        f"http://127.0.0.1:{cfg.feedback.port}/api/training/submit",
        stack.api_key,
        DEMO_TENANT,
        cfg.model.served_name,
        get_template("plain"),
        max_tokens=8,
    )

    async def serve_and_rate(n_needed: int) -> list[dict]:
        replies = []
        async with httpx.AsyncClient(timeout=120) as http:
            for prefix, suffix in PROMPTS * 3:
                prompt = client.template.render(prefix, suffix)
                res = await client.complete(http, prompt)
                assert res.status == 200 and not res.error, res.error
                assert (res.version, res.arm) == (None, "")  # a user key is never told its arm or version (issue 35)
                shown = res.text.rstrip()
                if not shown.strip():
                    continue
                assert r.hlen(keys.rollouts(DEMO_TENANT, prompt)) >= 1  # the rollout was recorded before [DONE]
                body = client.outcome(
                    prompt=prompt,
                    prefix=prefix,
                    suffix=suffix,
                    filepath="a.py",
                    shown=shown,
                    accepted=len(replies) % 2 == 0,
                    latency_ms=res.latency_ms,
                )
                status, reply = await client.post_outcome(http, body)
                assert status == 200 and "policy_version" not in reply, reply
                replies.append(reply)
                if sum(x.get("status") == "accepted_for_training" for x in replies) >= n_needed:
                    break
        return replies

    replies = asyncio.run(serve_and_rate(2))
    assert sum(x["status"] == "accepted_for_training" for x in replies) >= 2

    # The trainer consumes the samples, steps, checkpoints v1; the reloader loads it and switches routing.
    wait_for(
        lambda: PolicyTable.from_redis(r.hgetall(keys.policy)).stable >= 1,
        timeout=240,
        what="policy v1 to become stable",
    )
    v1 = stack.paths.state / "checkpoints" / cfg.job / "v1"
    assert (v1 / "manifest.json").is_file()
    tensors = safe_open(str(v1 / "adapter_model.safetensors"), "pt")
    adapted = {name.split(".layers.")[1].split(".")[0] for name in tensors.keys()}  # noqa: SIM118 - not a dict
    assert adapted == {"1"}  # lastLayers: 1 of the tiny model's 2
    assert r.xlen(keys.samples) == 0  # acknowledged and deleted only after the checkpoint

    evaluator = dataclasses.replace(client, api_key=ensure_demo_key(stack.paths, "eval"))

    async def next_completion():  # routed as any user (no pin); an eval key is told the version (issue 35)
        async with httpx.AsyncClient(timeout=120) as http:
            return await evaluator.complete(http, evaluator.template.render(*PROMPTS[0]))

    # The gateway refreshes its cached policy table and model list in the background (~0.5 s): wait for it.
    served: list = []
    wait_for(
        lambda: served.append(asyncio.run(next_completion())) or (served[-1].version or 0) >= 1,
        timeout=30,
        interval=0.2,
        what="the gateway to serve v1",
    )
    res = served[-1]
    assert res.status == 200 and res.version >= 1
    assert all(s.status == 200 for s in served)  # no request failed across the switch

    async def pinned(version: int, who: ContinueClient = evaluator):
        async with httpx.AsyncClient(timeout=120) as http:
            return await who.complete(http, who.template.render(*PROMPTS[1]), pin_version=version)

    refused = asyncio.run(pinned(0, client))  # a user key may not choose its policy
    assert refused.status == 403 and "X-OnlineRL-Version" in refused.error
    base = asyncio.run(pinned(0))  # evaluation (an eval key) can still ask for the base model explicitly
    assert (base.status, base.version, base.arm) == (200, 0, "eval")
    missing = asyncio.run(pinned(99))
    assert missing.status == 409 and "not loaded" in missing.error
    records = [v for v in r.hvals(keys.rollouts(DEMO_TENANT, client.template.render(*PROMPTS[0])))]
    assert any(b'"policy_version":1' in v or b'"policy_version": 1' in v for v in records)
    r.close()
