"""Stock Continue against the real gateway (the session's shared vLLM engine on CPU) and the real feedback service:
completions are requested at the printed config's apiBase as Continue requests them (onlinerl.loop.continue_client),
and the outcomes are built with Continue's published dev-data schemas and POSTed, as its DataLogger posts them, to the
printed data: destination (tests/continue/). What the gateway served trains once: the accept and the reject are
samples joined to the gateway's own rollouts, the repeated accept is a duplicate.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
import redis
import yaml

from onlinerl.config import OnlineRLConfig
from onlinerl.fim import get_template
from onlinerl.keys import Keys
from onlinerl.loop.continue_client import CompletionResult, ContinueClient
from onlinerl.loop.stack import continue_snippet
from onlinerl.valkey import EmbeddedValkey
from tests.engines import SharedEngine
from tests.feedback.conftest import JOB, stream_entries
from tests.feedback.gateway_stack import gateway_and_feedback
from tests.feedback.test_stock_continue import continue_client, outcome

QWEN = get_template("qwen")
KEY = "key-acme-continue"


async def two_served(client: ContinueClient) -> list[tuple[str, CompletionResult]]:
    """Two completions that show something (the tiny random model may say only whitespace for some prompts)."""
    out = []
    async with httpx.AsyncClient(timeout=120) as http:
        for i in range(30):
            prompt = QWEN.render(f"stock_{i} = ", "\n")
            res = await client.complete(http, prompt)
            assert res.status == 200 and not res.error, res.error
            if res.text.strip():
                out.append((prompt, res))
            if len(out) == 2:
                return out
    raise AssertionError("fewer than two non-empty completions")


@pytest.mark.vllm
def test_stock_continue_through_the_gateway_trains_what_it_was_served(
    empty_valkey: EmbeddedValkey, tmp_path: Path, tiny_lora_engine: SharedEngine
) -> None:
    keys = Keys(JOB)
    with gateway_and_feedback(tmp_path, empty_valkey.url, tiny_lora_engine, {"acme": [KEY]}) as ep:
        ports = {"serving": {"port": int(ep.api.split(":")[-1].split("/")[0])}}
        ports["feedback"] = {"port": int(ep.feedback.url.rsplit(":", 1)[1])}
        printed = continue_snippet(OnlineRLConfig.model_validate({"model": {"fimTemplate": "qwen"}, **ports}), KEY)
        model = yaml.safe_load(printed)["models"][0]
        assert model["apiBase"] == ep.api
        client = ContinueClient(model["apiBase"], "", model["apiKey"], "", model["model"], QWEN, max_tokens=8)
        (p1, r1), (p2, r2) = asyncio.run(two_served(client))

        accept, reject = outcome(p1, r1.text, True), outcome(p2, r2.text, False)
        events = [{"name": "autocomplete", "data": d} for d in (accept, reject, accept)]
        answer = continue_client({"config": printed, "events": events})
        assert answer["error"] is None, answer["error"]
        first, second, again = answer["posts"]
        assert [p["status"] for p in (first, second, again)] == [200, 200, 200]
        assert first["body"]["status"] == second["body"]["status"] == "accepted_for_training", (first, second)
        assert (again["body"]["status"], again["body"]["reason"]) == ("duplicate", "completion_id_seen")
        admin = redis.Redis.from_url(empty_valkey.url)
        try:
            samples = stream_entries(admin, keys.samples)
        finally:
            admin.close()
        assert [(s["event_id"], s["accepted"]) for s in samples] == [
            (accept["completionId"], True),
            (reject["completionId"], False),
        ]
        assert {s["rollout_id"] for s in samples} == {first["body"]["rollout_id"], second["body"]["rollout_id"]}
