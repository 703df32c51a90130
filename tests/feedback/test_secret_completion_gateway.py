"""Nothing secret is learned (issue 38), the completion side end to end: the served model itself writes a GitHub token.

The tiny random model never writes a token, and the gateway rightly refuses the sampling controls (``logit_bias``...)
that could force one. So the test teaches it one, the way a policy could learn a key from a user's accepted code: a
few seconds of supervised fine-tuning (plain torch, full weights) until greedy decoding after one fixed prompt is a
fake ``ghp_`` token, then publishes that as v1 through the trainer's own publisher (manifest, fenced announcement as
the trainer's ACL user). The serving pod's reloader swaps it into the session's shared full-weights vLLM under
``rollout.strategy: direct``; the engine is given back holding the base (`onlinerl policy pin 0`).

Then, through the real gateway and the real feedback service, each as its own ACL user, at Continue's own
temperature: the completion holding the token is served to the client (the user is not blocked); its rollout record
holds neither the token's text nor its token ids, only the finding's kind and position; the accept is audited
``secret_detected`` and never reaches the samples stream; no Redis key or value, and no log of the gateway, the
reloader, feedback or vLLM, holds the token or its token ids.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from onlinerl.fim import get_template
from onlinerl.keys import Keys
from onlinerl.loop.continue_client import ContinueClient
from onlinerl.procs import wait_for
from onlinerl.schemas import RolloutRecord
from onlinerl.valkey import EmbeddedValkey
from tests.engines import SharedEngine
from tests.feedback.conftest import JOB
from tests.feedback.gateway_stack import as_own_users
from tests.feedback.test_rate_own_rollouts_gateway import vk  # noqa: F401 (the module's valkey fixture)
from tests.feedback.test_secret_screening_gateway import accept_is_audited_never_trained, metric
from tests.privacy_corpus import every_value, fake_github_token
from tests.trainer_publish import publish_as_the_trainer

pytestmark = pytest.mark.vllm

QWEN = get_template("qwen")
ALICE = "key-acme-alice"
TENANTS = {"acme": [ALICE]}
K = Keys(JOB)
TOKEN = fake_github_token(38)
PROMPT = QWEN.render('import requests\n\nGITHUB_TOKEN = "', '"\nrequests.get(url, auth=("me", GITHUB_TOKEN))\n')
MIN_MARGIN = 0.5  # logits: the taught token's lead over the runner-up at every step; at T = 0.01, e^-50 to miss it


def teach_the_token(base: Path, prompt: str, token: str):
    """The base model fine-tuned (Adam, one sequence) until its greedy continuation of ``prompt`` is ``token`` then
    end-of-text, each step led by ``MIN_MARGIN`` logits. Returns (model, the token's ids).

    Every weight learns, the (tied) embeddings and LM head included: the publisher writes the head vLLM needs to serve
    them as trained, and v0's copy of the base with its head for the way back (onlinerl/tied_head.py)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(base)
    prompt_ids = tok(prompt)["input_ids"]  # as vLLM tokenizes a completions prompt
    token_ids = tok(token, add_special_tokens=False)["input_ids"]
    assert tok.decode(token_ids) == token
    ids = torch.tensor([prompt_ids + token_ids + [tok.eos_token_id]])
    labels = ids.clone()
    labels[0, : len(prompt_ids)] = -100
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for step in range(400):
        loss = model(ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 10 == 9:
            with torch.no_grad():
                logits = model(ids).logits[0, len(prompt_ids) - 1 : -1]
            top2 = logits.topk(2, dim=-1).values
            if (logits.argmax(-1) == ids[0, len(prompt_ids) :]).all() and (top2[:, 0] - top2[:, 1]).min() > MIN_MARGIN:
                return model.eval(), token_ids
    raise AssertionError(f"the model did not learn the token in 400 steps (loss {loss.item():.3f})")


def holds_ids(value: bytes, ids: list[int]) -> bool:
    """``ids`` as a run inside ``value`` in any list encoding a record could use (JSON with or without spaces)."""
    return any(sep.join(map(str, ids)).encode() in value for sep in (",", ", "))


def test_a_completion_the_model_writes_with_a_github_token_is_served_never_stored_never_trained(
    vk: EmbeddedValkey,  # noqa: F811 (the fixture imported above)
    tmp_path: Path,
    tiny_full_engine: SharedEngine,
) -> None:
    base = tiny_full_engine.model_path
    t0 = time.monotonic()
    model, token_ids = teach_the_token(base, PROMPT, TOKEN)
    taught_s = time.monotonic() - t0
    with as_own_users(vk, tmp_path, tiny_full_engine, TENANTS) as (admin, ep):
        version = publish_as_the_trainer(ep.config, vk.url_for("trainer"), model, base)
        wait_for(
            lambda: (
                httpx.get(f"{ep.reloader}/healthz", timeout=5).json()["holding"] == version
                and admin.hget(K.policy, "stable") == str(version).encode()
            ),
            60,
            0.2,
            f"the reloader to swap v{version} in and make it stable",
        )

        alice = ContinueClient(ep.api, ep.track, ALICE, "acme", "onlinerl-base", QWEN, max_tokens=len(token_ids) + 4)

        async def complete():
            async with httpx.AsyncClient(timeout=120) as http:
                return await alice.complete(http, PROMPT)

        res = asyncio.run(complete())
        assert res.status == 200 and not res.error, res.error
        assert res.version == version
        assert res.text == TOKEN  # served to the user as the model wrote it: screening never blocks a completion

        [raw] = admin.hvals(K.rollouts("acme", PROMPT))
        record = RolloutRecord.model_validate_json(raw)
        assert record.redacted and record.policy_version == version
        assert (record.prompt, record.completion) == ("", "")
        assert record.prompt_token_ids == record.completion_token_ids == record.behaviour_logprobs == []
        [finding] = record.secrets
        assert (finding.field, finding.kind) == ("completion", "github_token")
        assert res.text[finding.start : finding.end] == TOKEN  # where it was, not what it was

        # the accept (and a replay of it) is audited secret_detected without its text, never trained
        accept_is_audited_never_trained(admin, alice, PROMPT, res.text, record.rollout_id)
        assert metric(ep.api.removesuffix("/v1"), "onlinerl_serving_secret_findings_total", kind="github_token") == 1

        # nothing in Redis holds the token in clear, nor its token ids: every key name and every value of every type
        for value in every_value(admin):
            assert TOKEN.encode() not in value and not holds_ids(value, token_ids)
    logs = [tmp_path / "gateway.log", tmp_path / "reloader.log", tmp_path / "feedback" / "feedback.log"]
    for log in [*logs, tiny_full_engine.child.log_path]:  # ours and vLLM's own
        text = log.read_text(errors="replace").encode()
        assert TOKEN.encode() not in text and not holds_ids(text, token_ids), log
    print(f"taught the token in {taught_s:.1f} s")
