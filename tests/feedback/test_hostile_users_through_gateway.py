"""Hostile users against the REAL gateway and vLLM (issue 35): a user key learns nothing about its arm, and a padded
accept adds only the served characters to the arm's guardrail counters.

Real valkey, real vLLM on CPU (tiny random model), the real gateway (``serving.routingHeaders`` at the product's
default, ``privileged``) and feedback processes. The completions are the gateway's own, so the rollout records, the
arm counters and the per-user ledgers are what production writes.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import redis

from onlinerl.fim import get_template
from onlinerl.keys import Keys

from .conftest import JOB, KEYS, event
from .gateway_stack import Endpoints, gateway_and_feedback

pytestmark = pytest.mark.vllm

QWEN = get_template("qwen")
USER_KEY, EVAL_KEY = KEYS["acme"][0], "key-acme-eval"
ROUTING_HEADERS = ("x-onlinerl-arm", "x-onlinerl-policy-version")


@dataclass
class Stack:
    ep: Endpoints
    redis: redis.Redis
    keys: Keys


@pytest.fixture(scope="module")
def stack(module_valkey, tmp_path_factory, tiny_lora_engine) -> Iterator[Stack]:
    tenants = {"acme": [USER_KEY, {"key": EVAL_KEY, "role": "eval"}]}
    r = redis.Redis.from_url(module_valkey.url)
    try:
        with gateway_and_feedback(
            tmp_path_factory.mktemp("gw"),
            module_valkey.url,
            tiny_lora_engine,
            tenants,
            serving={"routingHeaders": "privileged"},  # the product's default, stated: the test is about it
        ) as ep:
            yield Stack(ep, r, Keys(JOB))
    finally:
        r.close()


def complete(s: Stack, key: str, prompt: str, stream: bool = False, pin: int | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"}
    if pin is not None:
        headers["X-OnlineRL-Version"] = str(pin)
    body = {"model": "x", "prompt": prompt, "max_tokens": 12, "temperature": 0.7, "stream": stream}
    resp = httpx.post(f"{s.ep.api}/completions", json=body, headers=headers, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp


def text_of(resp: httpx.Response) -> str:
    if not resp.headers["content-type"].startswith("text/event-stream"):
        return resp.json()["choices"][0]["text"]
    import json

    events = [e[6:] for e in resp.text.split("\n\n") if e.startswith("data: ") and e != "data: [DONE]"]
    return "".join(json.loads(e)["choices"][0]["text"] for e in events)


def served_something(s: Stack, key: str, name: str) -> tuple[str, str]:
    """(prompt, text) of a completion for ``key`` that shows something (the tiny model may say only whitespace)."""
    for i in range(20):
        prompt = QWEN.render(f"{name}_{i} = ", "\n")
        text = text_of(complete(s, key, prompt))
        if text.strip():
            return prompt, text
    raise AssertionError(f"no non-empty completion for {name!r}")


def rate(s: Stack, key: str, body: dict) -> dict:
    headers = {"Authorization": f"Bearer {key}", "X-Project-ID": "acme"}
    resp = httpx.post(s.ep.track, json=body, headers=headers, timeout=30)
    assert resp.status_code == 200, resp.text
    return resp.json()


def counters(s: Stack) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in s.redis.hgetall(s.keys.stats(0, "stable")).items()}


def test_a_user_key_never_learns_its_arm_or_version(stack: Stack) -> None:
    for stream in (False, True):
        resp = complete(stack, USER_KEY, QWEN.render("value = ", "\n"), stream=stream)
        assert resp.headers["x-onlinerl-rollout-id"]  # a random id: says nothing about the arm
        assert not [h for h in ROUTING_HEADERS if h in resp.headers], dict(resp.headers)
    routed = complete(stack, EVAL_KEY, QWEN.render("other = ", "\n"))  # eval keys (tools, the gate) still see them
    assert (routed.headers["x-onlinerl-arm"], routed.headers["x-onlinerl-policy-version"]) == ("stable", "0")
    pinned = complete(stack, EVAL_KEY, QWEN.render("pinned = ", "\n"), pin=0)
    assert (pinned.headers["x-onlinerl-arm"], pinned.headers["x-onlinerl-policy-version"]) == ("eval", "0")

    prompt, text = served_something(stack, USER_KEY, "user_rates")
    reply = rate(stack, USER_KEY, event(prompt, text, accepted=False))
    assert reply["status"] == "accepted_for_training" and "policy_version" not in reply, reply
    prompt, text = served_something(stack, EVAL_KEY, "eval_rates")
    assert rate(stack, EVAL_KEY, event(prompt, text, accepted=False))["policy_version"] == 0


def test_a_padded_accept_adds_only_the_served_characters(stack: Stack) -> None:
    prompt, text = served_something(stack, USER_KEY, "padded")
    core = text.strip()  # what the join keeps of a shown text with whitespace around it
    before = counters(stack)
    padded = " " * 1500 + core + " " * 1500  # 3,000 spaces of the client's own
    reply = rate(stack, USER_KEY, event(prompt, padded, accepted=True))
    assert reply["status"] == "accepted_for_training" and reply["match"] in ("exact", "trimmed"), reply
    after = counters(stack)
    grew = {k: after.get(k, 0) - before.get(k, 0) for k in ("shown", "accepted", "shown_chars", "accepted_chars")}
    assert grew == {"shown": 1, "accepted": 1, "shown_chars": len(core), "accepted_chars": len(core)}
    assert len(core) < 100  # 12 tokens at most: the client's 3,000 spaces counted nowhere
