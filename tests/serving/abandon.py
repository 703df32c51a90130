"""One check, used by the sidecar's and the in-process gateway's tests: a non-streaming client that gives up must
not leave vLLM generating for nobody (the gateway counts a 499 and vLLM drops the request early)."""

from __future__ import annotations

import httpx
import pytest

from onlinerl.procs import wait_for


def series_sum(text: str, name: str, *labels: str) -> float:
    """The sum of every sample of ``name`` (with all of ``labels``) on a Prometheus text page."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and all(lab in line for lab in labels)
    )


def assert_a_leaving_client_aborts_the_generation(gateway: httpx.Client, body: dict, headers: dict) -> None:
    """POST ``body`` (2,000 tokens, not streamed) through ``gateway`` and give up after 0.3 s: the gateway sees the
    client leave (499) and vLLM stops before writing them all."""
    assert body["max_tokens"] >= 2000 and not body.get("stream")
    before = series_sum(gateway.get("/engine/metrics").text, "vllm:generation_tokens_total")
    with pytest.raises(httpx.ReadTimeout):  # the client gives up long before the tiny model could write them
        gateway.post("/v1/completions", json=body, headers=headers, timeout=httpx.Timeout(0.3, connect=5.0))
    wait_for(
        lambda: series_sum(gateway.get("/metrics").text, "onlinerl_serving_requests_total", 'code="499"') >= 1,
        10,
        what="the gateway to see the client leave",
    )
    wait_for(
        lambda: series_sum(gateway.get("/engine/metrics").text, "vllm:num_requests_running") == 0,
        15,
        what="vLLM to drop the abandoned request",
    )
    generated = series_sum(gateway.get("/engine/metrics").text, "vllm:generation_tokens_total") - before
    assert generated < body["max_tokens"]  # stopped early: vLLM aborted
