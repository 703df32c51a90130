"""Stock Continue against the real gateway (the session's shared vLLM engine on CPU) and the real feedback service,
through Continue's own published code only (tests/continue/continue_client.mjs): completions for the printed config's
autocomplete model are streamed with ``@continuedev/fetch`` (``fetchwithRequestOptions`` and ``streamSse``: what
stock Continue's autocomplete sends for a ``provider: openai`` model, URL, headers and body included) and through
``@continuedev/openai-adapters`` (streamed and not), and the outcomes are built with Continue's published dev-data
schemas and POSTed, as its DataLogger posts them, to the printed data: destination. Each completion's text arrives and
is the rollout the gateway recorded; what the gateway served trains once: the accept and the reject are samples joined
to the gateway's own rollouts, the repeated accept is a duplicate.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
import yaml

from onlinerl.config import OnlineRLConfig
from onlinerl.fim import get_template
from onlinerl.keys import Keys
from onlinerl.loop.stack import continue_snippet
from onlinerl.schemas import RolloutRecord
from onlinerl.valkey import EmbeddedValkey
from onlinerl_serving.routing import user_hash
from tests.engines import SharedEngine
from tests.feedback.conftest import JOB, stream_entries
from tests.feedback.gateway_stack import gateway_and_feedback
from tests.feedback.test_stock_continue import continue_client, outcome

QWEN = get_template("qwen")
KEY = "key-acme-continue"


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
        prompts = [QWEN.render(f"stock_{i} = ", "\n") for i in range(8)]
        asked = [{"prompt": p, "via": "continue"} for p in prompts[:6]]
        asked += [{"prompt": prompts[6], "via": "adapter", "stream": True}]
        asked += [{"prompt": prompts[7], "via": "adapter", "stream": False}]
        done = continue_client({"config": printed, "completions": asked})
        assert done["error"] is None, done["error"]
        got = done["completions"]
        assert [(c["status"], c.get("error")) for c in got] == [(200, None)] * len(asked), got
        sent = got[0]["sent"]
        # what stock Continue's autocomplete sends for the printed model (provider openai, legacy completions)
        assert sent["url"] == f"{ep.api}/completions"
        assert sent["headers"] == {
            "Content-Type": "application/json",
            "Authorization": f"Bearer {KEY}",
            "api-key": KEY,
        }
        assert {k: sent["body"][k] for k in ("model", "max_tokens", "temperature", "stream")} == {
            "model": model["model"],
            "max_tokens": model["defaultCompletionOptions"]["maxTokens"],
            "temperature": 0.01,
            "stream": True,
        }
        assert sent["body"]["prompt"] == prompts[0] and "```" in sent["body"]["stop"]
        assert [c["sent"]["body"]["stream"] for c in got[6:]] == [True, False]
        admin = redis.Redis.from_url(empty_valkey.url)
        try:
            for prompt, c in zip(prompts, got, strict=True):  # each completion is the rollout the gateway recorded
                [raw] = admin.hvals(keys.rollouts("acme", prompt))
                rec = RolloutRecord.from_json(raw)
                assert rec.completion == c["text"] and rec.user_hash == user_hash(KEY), (rec.completion, c["text"])
            assert any(len(c["chunks"]) > 1 for c in got[:6]), "no completion came in more than one chunk"
        finally:
            admin.close()
        shown = [(p, c) for p, c in zip(prompts, got, strict=True) if c["text"].strip()]
        assert len(shown) >= 2, "fewer than two non-empty completions (the tiny random model said only whitespace)"
        (p1, r1), (p2, r2) = shown[:2]

        accept, reject = outcome(p1, r1["text"], True), outcome(p2, r2["text"], False)
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
