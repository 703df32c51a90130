"""Redis failures: down means 503 (never 200), and a Redis crash in the middle of load loses no acknowledged event.

Each test has its own valkey (AOF, appendfsync always) and its own feedback process, because it kills the valkey.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import orjson
import pytest
import redis

from onlinerl.config import RedisConfig
from onlinerl.fim import get_template
from onlinerl.procs import http_ok, wait_for

from .conftest import event, headers, start_feedback
from .rollouts import make_rollout, record_rollout

SUBMIT = "/api/training/submit"
REDIS = RedisConfig()  # the service runs with the default Redis timeouts
PROMPT = get_template("qwen").render("def square(x):\n", "\n")
COMPLETION = "    return x * x"


@pytest.fixture
def feedback(valkey, tmp_path):
    srv = start_feedback(tmp_path, valkey.url)
    try:
        yield srv
    finally:
        srv.stop()


def test_redis_down_answers_503_fast_and_records_nothing(valkey, feedback, keys, tokenizer):
    r = redis.Redis.from_url(valkey.url)
    record_rollout(r, keys, make_rollout(tokenizer, tenant="acme", prompt=PROMPT, completion=COMPLETION))
    r.close()
    body = event(PROMPT, COMPLETION)
    valkey.kill()
    deadline = REDIS.connect_timeout_seconds + REDIS.socket_timeout_seconds  # the longest a Redis call may take
    with httpx.Client(timeout=4 * deadline) as http:
        started = time.monotonic()
        resp = http.post(feedback.url + SUBMIT, json=body, headers=headers())
        elapsed = time.monotonic() - started
        assert resp.status_code == 503 and resp.headers["Retry-After"] == "2", resp.text
        assert resp.json()["reason"] == "redis_unavailable"
        # answered within the service's own Redis deadlines: a bounded wait, never a hang until the client gives up
        assert elapsed < deadline, f"503 took {elapsed:.1f}s, past the Redis deadlines ({deadline:.0f}s)"
        assert http.get(feedback.url + "/readyz").status_code == 503
        assert http.get(feedback.url + "/healthz").status_code == 200

        valkey.start()
        wait_for(lambda: http_ok(feedback.url + "/readyz"), timeout=10, what="readyz after valkey came back")
        # The 503 recorded nothing, so the client's retry is a first delivery (the restarted valkey also lost
        # its script cache: the service reloads the Lua script by itself).
        again = http.post(feedback.url + SUBMIT, json=body, headers=headers())
        assert again.status_code == 200 and again.json()["status"] == "accepted_for_training", again.text
        metrics = http.get(feedback.url + "/metrics").text
    assert 'onlinerl_feedback_responses_total{code="503"}' in metrics
    r = redis.Redis.from_url(valkey.url)
    assert [orjson.loads(f[b"data"])["event_id"] for _, f in r.xrange(keys.samples)] == [body["completionId"]]
    r.close()


CRASH_PROMPTS = 3000  # one served rollout per event (each is trained at most once); more than the load ever posts


def crash_prompt(i: int) -> str:
    return get_template("qwen").render(f"def square_{i}(x):\n", "\n")


async def _client_loop(
    http: httpx.AsyncClient,
    url: str,
    acked: dict[str, str],
    stop: asyncio.Event,
    codes: dict[int, int],
    prompts: Iterator[int],
) -> None:
    """Like a well-behaved client: each event is resent after 503 until it gets a 200."""
    while not stop.is_set():
        body = event(crash_prompt(next(prompts)), COMPLETION)
        while True:
            try:
                resp = await http.post(url, json=body, headers=headers())
            except httpx.HTTPError:
                codes[0] = codes.get(0, 0) + 1
                await asyncio.sleep(0.05)
                continue
            codes[resp.status_code] = codes.get(resp.status_code, 0) + 1
            if resp.status_code == 200:
                out = resp.json()
                acked[body["completionId"]] = out.get("first_outcome", out["status"])
                break
            assert resp.status_code == 503, resp.text
            await asyncio.sleep(0.05)


async def _load_with_crash(valkey, url: str) -> tuple[dict[str, str], dict[int, int], int]:
    acked: dict[str, str] = {}
    codes: dict[int, int] = {}
    stop = asyncio.Event()
    async with httpx.AsyncClient(timeout=10) as http:
        prompts = iter(range(CRASH_PROMPTS))
        clients = [asyncio.create_task(_client_loop(http, url, acked, stop, codes, prompts)) for _ in range(16)]
        await asyncio.to_thread(wait_for, lambda: len(acked) >= 300, 60, 0.01, "300 acked events before the crash")
        before = len(acked)
        await asyncio.to_thread(valkey.kill)  # SIGKILL: only what was fsynced survives
        await asyncio.to_thread(valkey.start)
        await asyncio.to_thread(wait_for, lambda: len(acked) >= before + 300, 60, 0.01, "300 acked after restart")
        stop.set()
        await asyncio.wait_for(asyncio.gather(*clients), 30)
    return acked, codes, before


def test_redis_crash_mid_load_loses_no_acknowledged_event(valkey, feedback, keys, tokenizer):
    r = redis.Redis.from_url(valkey.url)
    base = make_rollout(tokenizer, tenant="acme", prompt=PROMPT, completion=COMPLETION)
    with r.pipeline(transaction=False) as pipe:  # recorded before the load: on disk (fsync always) before the crash
        for i in range(CRASH_PROMPTS):
            rec = base.model_copy(update={"prompt": crash_prompt(i), "rollout_id": f"cmpl-crash-{i}"})
            pipe.hset(keys.rollouts("acme", rec.prompt), rec.rollout_id, rec.to_json())
        pipe.execute()
    r.close()
    acked, codes, before = asyncio.run(_load_with_crash(valkey, feedback.url + SUBMIT))
    r = redis.Redis.from_url(valkey.url)
    in_stream = [orjson.loads(f[b"data"])["event_id"] for _, f in r.xrange(keys.samples)]
    r.close()
    assert set(acked.values()) == {"accepted_for_training"}
    assert len(in_stream) == len(set(in_stream))  # nothing trained twice
    assert set(in_stream) == set(acked)  # every acknowledged event is there, and nothing unacknowledged
    assert len(acked) >= before + 300
    print(f"acked={len(acked)} before_crash={before} codes={codes}")
    assert codes.get(503, 0) + codes.get(0, 0) > 0, f"the crash was not observed by any client: {codes}"
