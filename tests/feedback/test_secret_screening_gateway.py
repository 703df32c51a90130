"""Nothing secret is learned (issue 38), through the real gateway (shared tiny vLLM engine on CPU) and the real
feedback service, each on a real valkey as its own ACL user.

The prompt side end to end: a completion whose prompt holds a seeded AWS access key id is served as usual (200,
text); the recorded rollout holds no text and no token ids, only the finding's kind and position; the user's accept
is audited ``secret_detected`` and never reaches the samples stream; no Redis key or value anywhere holds the key,
and neither service's log does. Also an uploaded accept whose shown text holds a GitHub token the model never wrote
is audited ``secret_detected`` without the text. The completion side, a token the served model itself writes, is
tests/feedback/test_secret_completion_gateway.py (the model fine-tuned to write one).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import orjson
import pytest
import redis

from onlinerl.fim import get_template
from onlinerl.keys import Keys
from onlinerl.loop.continue_client import CompletionResult, ContinueClient
from onlinerl.schemas import RolloutRecord
from onlinerl.valkey import EmbeddedValkey
from tests.engines import SharedEngine
from tests.feedback.conftest import JOB
from tests.feedback.gateway_stack import as_own_users
from tests.feedback.test_rate_own_rollouts_gateway import rate, vk  # noqa: F401 (vk: the module's valkey fixture)
from tests.privacy_corpus import every_value, fake_aws_key_id, fake_github_token

QWEN = get_template("qwen")
ALICE = "key-acme-alice"
TENANTS = {"acme": [ALICE]}
K = Keys(JOB)
AWS_KEY = fake_aws_key_id(7)
GITHUB_TOKEN = fake_github_token(7)


async def serve(client: ContinueClient, code: str) -> tuple[str, CompletionResult]:
    """One completion that shows something for a prompt holding ``code`` (the tiny model may say only whitespace)."""
    async with httpx.AsyncClient(timeout=120) as http:
        for i in range(20):
            prompt = QWEN.render(f"{code}\nvalue_{i} = ", "\n")
            res = await client.complete(http, prompt)
            assert res.status == 200 and not res.error, res.error
            if res.text.strip():
                return prompt, res
    raise AssertionError("no non-empty completion")


def metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(f"{name}{{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name}{{{want}}} not exported")


def accept_is_audited_never_trained(
    admin: redis.Redis, client: ContinueClient, prompt: str, shown: str, rollout_id: str
) -> None:
    """The user accepts ``shown``: feedback rejects it as ``secret_detected`` for ``rollout_id``, audits it without
    its text, puts nothing on the samples stream; a second delivery (a retry, a replay) is no different."""
    code, reply = asyncio.run(rate(client, prompt, shown))
    assert code == 200, reply
    assert (reply["status"], reply["reason"], reply["rollout_id"]) == ("rejected", "secret_detected", rollout_id)
    assert admin.xlen(K.samples) == 0  # never trained
    [(_, fields)] = admin.xrange(K.audit)
    audited = orjson.loads(fields[b"data"])
    assert (audited["reason"], audited["rollout_id"], audited["completion"]) == ("secret_detected", rollout_id, "")
    code, again = asyncio.run(rate(client, prompt, shown))
    assert code == 200 and again["status"] in ("duplicate", "rejected"), again
    assert admin.xlen(K.samples) == 0


@pytest.mark.vllm
def test_a_secret_in_the_prompt_is_served_never_stored_never_trained(
    vk: EmbeddedValkey,  # noqa: F811 (the fixture imported above)
    tmp_path: Path,
    tiny_lora_engine: SharedEngine,
) -> None:
    with as_own_users(vk, tmp_path, tiny_lora_engine, TENANTS) as (admin, ep):
        alice = ContinueClient(ep.api, ep.track, ALICE, "acme", "onlinerl-base", QWEN, max_tokens=8)
        prompt, res = asyncio.run(serve(alice, f'AWS_ACCESS_KEY_ID = "{AWS_KEY}"'))  # served as usual

        [raw] = admin.hvals(K.rollouts("acme", prompt))  # filed under the prompt's digest, so feedback finds it
        record = RolloutRecord.model_validate_json(raw)
        assert record.redacted
        assert (record.prompt, record.completion) == ("", "")
        assert record.prompt_token_ids == record.completion_token_ids == record.behaviour_logprobs == []
        [finding] = [s for s in record.secrets if s.field == "prompt"]
        assert finding.kind == "aws_access_key_id"
        assert prompt[finding.start : finding.end] == AWS_KEY  # where it was, not what it was

        accept_is_audited_never_trained(admin, alice, prompt, res.text, record.rollout_id)

        # at feedback: an accept whose shown text holds a GitHub token the model never wrote (a client-side edit) is
        # audited secret_detected, its text not kept, nothing trained
        clean_prompt, clean = asyncio.run(serve(alice, "total = 0"))
        code, reply = asyncio.run(rate(alice, clean_prompt, clean.text + f' # "{GITHUB_TOKEN}"'))
        assert code == 200 and (reply["status"], reply["reason"]) == ("rejected", "secret_detected"), reply
        assert [f["kind"] for f in reply["findings"]] == ["github_token"]
        assert admin.xlen(K.samples) == 0

        assert metric(ep.api.removesuffix("/v1"), "onlinerl_serving_secret_findings_total", kind="aws_access_key_id")
        assert metric(ep.feedback.url, "onlinerl_feedback_secret_findings_total", kind="github_token") == 1

        # nothing in Redis holds either secret in clear: every key name and every value of every type
        for value in every_value(admin):
            assert AWS_KEY.encode() not in value and GITHUB_TOKEN.encode() not in value
    logs = (tmp_path / "gateway.log", tmp_path / "feedback" / "feedback.log", tiny_lora_engine.child.log_path)
    for log in logs:  # the gateway's, feedback's and vLLM's own
        text = log.read_text(errors="replace")
        assert AWS_KEY not in text and GITHUB_TOKEN not in text, log
