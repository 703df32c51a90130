"""The gateway's own CPU per completion, without the engine's jitter (issue 40).

``bench/serving_latency.py`` times the gateway against a real vLLM. There each request's time jitters by ±10 ms,
so at n = 600 its paired intervals are still ±0.3-0.5 ms wide, against a 1 ms bar for the gateway's own share.
This script measures only that share, as CPU time, and it resolves changes of a few µs:
- the gateway app (``gateway.create_app``: auth, parsing, routing, the rollout record written to a real valkey,
  the client's view of the response) runs with the in-process engine client (``inprocess.InProcessEngine``) in
  front of a stand-in for vLLM's app;
- the stand-in answers ``/v1/completions`` at once with a vLLM-shaped body: the token ids, log-probs and offsets
  that ``upstream_body`` asks for;
- each path's requests are ASGI calls, in one process, timed by CPU time; no sockets, no HTTP parsing (that costs
  both paths alike in vLLM's process).

Paths, interleaved in rounds:
  engine only    the stand-in called as vLLM's app is called directly (``direct+cap`` without HTTP);
  gateway        the same request through the gateway app (what ``gateway (in-process)`` adds).
The gateway's own CPU per request is the difference of the two. ``--profile`` prints cProfile's top functions of
the gateway path.

    .venv/bin/python bench/gateway_cpu.py                 # non-stream and stream, 2,000 requests each
    .venv/bin/python bench/gateway_cpu.py -n 5000 --tokens 64 --profile
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import io
import platform
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from proc_cpu import cpu_seconds  # bench/ is sys.path[0] when run as a script
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from onlinerl.asgi import http_scope
from onlinerl.auth import write_keys_file
from onlinerl.config import from_mapping
from onlinerl.fim import get_template
from onlinerl.valkey import EmbeddedValkey

KEY = "sk-bench-0123456789"
QWEN = get_template("qwen")
PROMPT = QWEN.render("import os\n\ndef read_config(path):\n    with open(path) as f:\n        return ", "\n")
PROMPT_TOKENS = 40  # the tiny model's tokenizer makes about this many of PROMPT


def client_body(stream: bool, max_tokens: int) -> bytes:
    """Continue's request, as bench/serving_latency.py sends it."""
    return orjson.dumps(
        {
            "model": "onlinerl-base",
            "prompt": PROMPT,
            "max_tokens": max_tokens,
            "temperature": 0.7,
            "stop": list(QWEN.stop),
            "stream": stream,
        }
    )


class StandInVllm:
    """vLLM's OpenAI completions route, answering at once: the body shape vLLM 0.32 gives for ``logprobs: 0`` and
    ``return_token_ids: true`` (one choice, ``tokens``/``token_logprobs``/``text_offset``/``top_logprobs``)."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens
        pieces = [f"tok{i % 7} " for i in range(tokens)]
        offsets, at = [], 0
        for p in pieces:
            offsets.append(at)
            at += len(p)
        self.choice = {
            "index": 0,
            "text": "".join(pieces),
            "logprobs": {
                "text_offset": offsets,
                "token_logprobs": [-0.5 - i * 0.01 for i in range(tokens)],
                "tokens": pieces,
                "top_logprobs": [{p: -0.5 - i * 0.01} for i, p in enumerate(pieces)],
            },
            "finish_reason": "length",
            "stop_reason": None,
            "prompt_logprobs": None,
            "prompt_token_ids": list(range(100, 100 + PROMPT_TOKENS)),
            "token_ids": [1000 + i for i in range(tokens)],
        }

    def whole(self, model: str) -> dict[str, Any]:
        usage = {"prompt_tokens": PROMPT_TOKENS, "total_tokens": PROMPT_TOKENS + self.tokens}
        return {
            "id": "cmpl-standin",
            "object": "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": [self.choice],
            "service_tier": None,
            "system_fingerprint": None,
            "usage": {**usage, "completion_tokens": self.tokens, "prompt_tokens_details": None},
            "kv_transfer_params": None,
        }

    def chunks(self, model: str) -> list[bytes]:
        """The SSE events of a stream, one token each, then ``[DONE]``."""
        c, out = self.choice, []
        for i in range(self.tokens):
            lp = c["logprobs"]
            choice = {
                "index": 0,
                "text": lp["tokens"][i],
                "logprobs": {
                    "text_offset": [lp["text_offset"][i]],
                    "token_logprobs": [lp["token_logprobs"][i]],
                    "tokens": [lp["tokens"][i]],
                    "top_logprobs": [lp["top_logprobs"][i]],
                },
                "finish_reason": "length" if i == self.tokens - 1 else None,
                "stop_reason": None,
                "token_ids": [c["token_ids"][i]],
            }
            if i == 0:
                choice["prompt_token_ids"] = c["prompt_token_ids"]
            event = {"id": "cmpl-standin", "object": "text_completion", "created": 0, "model": model}
            out.append(b"data: " + orjson.dumps({**event, "choices": [choice]}) + b"\n\n")
        return [*out, b"data: [DONE]\n\n"]

    def app(self) -> Starlette:
        async def completions(request: Request) -> Response:
            body = orjson.loads(await request.body())
            if body.get("stream"):
                chunks = self.chunks(body["model"])

                async def events():
                    for chunk in chunks:
                        yield chunk

                return StreamingResponse(events(), media_type="text/event-stream")
            return Response(orjson.dumps(self.whole(body["model"])), media_type="application/json")

        async def models(request: Request) -> Response:
            return JSONResponse({"object": "list", "data": [{"id": "onlinerl-base", "object": "model"}]})

        return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]), Route("/v1/models", models)])


async def call(
    app: Any,
    path: str,
    body: bytes,
    headers: list[tuple[bytes, bytes]],
    method: str = "POST",
    answer: list[bytes] | None = None,
) -> tuple[int, float]:
    """One ASGI request, as a server hands it over: the body in one message, then the client waiting.
    Returns the status and the wall time until the response's last byte was handed to the server (what the client
    waits for; the gateway's work after it, such as the record's acknowledgement, is not in it). ``answer``: a list
    the response body's pieces are appended to (the timed paths pass none)."""
    scope = http_scope(
        method, path, [(b"content-type", b"application/json"), *headers], ("127.0.0.1", 40000), ("127.0.0.1", 8000)
    )
    sent = False
    never = asyncio.get_running_loop().create_future()
    status, answered = 0, 0.0
    t0 = time.perf_counter()

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await never  # the client stays until the response ends
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        nonlocal status, answered
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            if answer is not None:
                answer.append(message.get("body", b""))
            if not message.get("more_body", False):
                answered = time.perf_counter() - t0

    await app(scope, receive, send)
    never.cancel()
    return status, answered


_EVICT = bytearray(64 << 20)  # larger than any L3 this runs on
_UNRELATED = [{"k": i, "v": str(i) * 3} for i in range(20_000)]


def evict_caches() -> None:
    """What ~80 ms of vLLM's own work between two requests does to the caches, roughly: every cache line of 64 MB
    written, and unrelated Python run (its code and objects pushed into the caches instead of the gateway's)."""
    _EVICT[::64] = bytes(len(_EVICT) // 64)
    sorted(_UNRELATED, key=lambda d: d["v"])
    orjson.dumps(_UNRELATED[:5000])


@dataclass
class PathFigures:
    """Per round: CPU seconds per request of this process and of valkey-server; per request: wall to the last byte."""

    cpu: list[float] = field(default_factory=list)
    valkey_cpu: list[float] = field(default_factory=list)
    wall: list[float] = field(default_factory=list)


async def measure(
    args: argparse.Namespace, tmp: Path, valkey_url: str, valkey_pid: int | None = None
) -> dict[str, dict[str, float]]:
    """Each mode's figures, in µs: both paths' CPU, the gateway's own CPU (per round, gateway - engine only),
    valkey-server's CPU per request of the gateway path, and the gateway's own wall time to the last byte."""
    from onlinerl_serving.gateway import create_app
    from onlinerl_serving.inprocess import InProcessEngine
    from onlinerl_serving.requests import Limits, parse_completion_request, upstream_body

    keys = write_keys_file(tmp / "keys.yaml", {"bench": [KEY]})
    cfg = from_mapping({"job": "bench", "redis": {"url": valkey_url}, "auth": {"apiKeysFile": str(keys)}})
    standin = StandInVllm(args.tokens).app()
    gateway = create_app(cfg, engine=InProcessEngine(standin, read_timeout=30))
    auth = [(b"authorization", f"Bearer {KEY}".encode())]
    profiler = cProfile.Profile() if args.profile else None
    valkey_cpu = (lambda: cpu_seconds(valkey_pid)) if valkey_pid else (lambda: 0.0)
    out: dict[str, dict[str, float]] = {}
    per_round = args.n // args.rounds
    async with running(gateway):
        for mode in args.modes:
            plain = client_body(mode == "stream", args.tokens)
            req = parse_completion_request(plain, Limits(10**6, 10**6, 10**6))
            # the engine-only path gets exactly the body the gateway sends vLLM (bench/serving_latency's direct+cap)
            paths = {
                "engine only": (standin, upstream_body(req, "onlinerl-base", cfg.serving.stream_interval), []),
                "gateway": (gateway, plain, auth),
            }
            for app, body, headers in paths.values():  # imports, caches, the record script's first run
                for _ in range(args.warmup):
                    assert (await call(app, "/v1/completions", body, headers))[0] == 200
            figures = {name: PathFigures() for name in paths}
            for _ in range(args.rounds):  # interleaved: a slow spell of the box hits both paths
                for name, (app, body, headers) in paths.items():
                    if profiler and name == "gateway":
                        profiler.enable()
                    v, used = valkey_cpu(), 0.0
                    for _ in range(per_round):
                        if args.cold:
                            evict_caches()
                            await asyncio.sleep(0.002)  # the record's acknowledgement comes in before the next
                        t = time.process_time()
                        status, answered = await call(app, "/v1/completions", body, headers)
                        used += time.process_time() - t
                        assert status == 200, status
                        figures[name].wall.append(answered)
                    figures[name].cpu.append(used / per_round)
                    figures[name].valkey_cpu.append((valkey_cpu() - v) / per_round)
                    if profiler:
                        profiler.disable()
            out[mode] = summarise(figures["engine only"], figures["gateway"])
        sent = len(args.modes) * (args.warmup + per_round * args.rounds)
        recorded, errors = await records_stored(gateway)
        if recorded != sent or errors:  # a figure for a path that skipped the record would be worthless
            raise RuntimeError(f"{sent} completions through the gateway, {recorded} records stored, {errors} errors")
    if profiler:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(args.sort).print_stats(args.top)
        print(text.getvalue())
    return out


async def records_stored(gateway: Any) -> tuple[float, float]:
    """(records stored, record errors), from the gateway's own /metrics."""
    parts: list[bytes] = []
    status, _ = await call(gateway, "/metrics", b"", [], method="GET", answer=parts)
    assert status == 200, status
    recorded = errors = 0.0
    for line in b"".join(parts).decode().splitlines():
        if line.startswith("onlinerl_serving_rollouts_recorded_total{"):
            recorded += float(line.split()[-1])
        elif line.startswith("onlinerl_serving_rollout_record_errors_total "):
            errors += float(line.split()[-1])
    return recorded, errors


def summarise(engine: PathFigures, gateway: PathFigures) -> dict[str, float]:
    own = [(g - e) * 1e6 for g, e in zip(gateway.cpu, engine.cpu, strict=True)]
    return {
        "engine only": statistics.median(engine.cpu) * 1e6,
        "gateway": statistics.median(gateway.cpu) * 1e6,
        "own": statistics.median(own),
        "own_min": min(own),
        "own_max": max(own),
        # clock ticks (10 ms): summed over all rounds, not a median of rounds
        "valkey": (sum(gateway.valkey_cpu) - sum(engine.valkey_cpu)) / len(gateway.valkey_cpu) * 1e6,
        "wall_own": (statistics.median(gateway.wall) - statistics.median(engine.wall)) * 1e6,
    }


@contextlib.asynccontextmanager
async def running(app: Any) -> AsyncIterator[None]:
    """The app's ASGI lifespan, started and then shut down (the gateway opens Redis and its refresh loops in it)."""
    queue: asyncio.Queue = asyncio.Queue()
    started, done = asyncio.Event(), asyncio.Event()

    async def send(message: dict) -> None:
        if message["type"] == "lifespan.startup.failed":
            raise RuntimeError(message.get("message"))
        (started if message["type"].startswith("lifespan.startup") else done).set()

    await queue.put({"type": "lifespan.startup"})
    task = asyncio.ensure_future(app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, queue.get, send))
    await asyncio.wait_for(started.wait(), 30)
    try:
        yield
    finally:
        await queue.put({"type": "lifespan.shutdown"})
        await asyncio.wait_for(done.wait(), 30)
        await task


def render(args: argparse.Namespace, out: dict[str, dict[str, float]]) -> str:
    cold = ", caches evicted before each request" if args.cold else ""
    lines = [
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.machine()}, python "
        f"{platform.python_version()}: `bench/gateway_cpu.py -n {args.n} --tokens {args.tokens}{' --cold' * args.cold}`"
        f" ({args.loop}{cold}, {args.rounds} rounds, medians of the rounds' means; own = gateway - engine only, per "
        "round)",
        "",
        "| mode | CPU: engine only µs | gateway µs | own µs (median) | own µs (rounds' range) | valkey-server µs "
        "| wall to the last byte: own µs (medians) |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode, r in out.items():
        lines.append(
            f"| {mode} | {r['engine only']:.0f} | {r['gateway']:.0f} | **{r['own']:.0f}** "
            f"| {r['own_min']:.0f} to {r['own_max']:.0f} | {r['valkey']:.0f} | {r['wall_own']:.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=2000, help="requests per path and mode")
    ap.add_argument("--rounds", type=int, default=10, help="interleaved rounds (each path n/rounds in a row)")
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--tokens", type=int, default=16, help="completion tokens (bench/serving_latency.py's default)")
    ap.add_argument("--loop", default="uvloop", choices=["uvloop", "asyncio"], help="uvloop: as vLLM runs")
    ap.add_argument("--modes", nargs="+", default=["non-stream", "stream"], choices=["non-stream", "stream"])
    ap.add_argument("--sort", default="tottime", help="cProfile's sort key (tottime, cumulative)")
    ap.add_argument(
        "--cold",
        action="store_true",
        help="evict the caches before each request (as vLLM's own work between two requests does); each request's "
        "CPU and wall time are taken around the request alone",
    )
    ap.add_argument("--profile", action="store_true", help="cProfile the gateway path; print the top functions")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="gwcpu-") as tmp, EmbeddedValkey(Path(tmp) / "valkey") as valkey:
        if args.loop == "uvloop":  # vLLM's API server runs on uvloop (uvicorn's default where it is installed)
            import uvloop

            asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
        pid = valkey.process.pid if valkey.process else None
        out = asyncio.run(measure(args, Path(tmp), valkey.url, pid))
    print(render(args, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
