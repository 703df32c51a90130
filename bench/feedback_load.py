"""Sustained-load benchmark of the feedback service, against a naive baseline, with an exact lost-event audit.

Load generator: wrk (Debian package ``wrk``, C + LuaJIT, one thread) so the generator costs little of the 2 shared
cores. Every request is a realistic Continue upload (~2.6 KB: rendered Qwen FIM prompt, prefix, suffix) that rates
*its own* served rollout: before each slice, ``--rollouts-per-second x --duration`` rollout records are written to
Redis through the gateway's own code path (``parse_completion_request`` -> ``RolloutAccumulator`` fed a vLLM-shaped
choice -> ``to_record`` -> ``RolloutStore.send``), each for a distinct prompt (``# cursor <slice>-<n>``), and request
``n`` of the slice carries ``completionId`` ``<slice>-<n>`` and that prompt. Since one served rollout yields at most
one training sample (a second event for it is a ``duplicate``), re-posting a few hundred rollouts would measure the
duplicate path, not ingest. A request past the written rollouts finds none (``unmatched``) and is reported.
wrk is closed-loop (N connections, each sends its next request when the previous answered), so the figures are the
throughput at that concurrency and the latency those requests saw.

Both servers run against the same embedded valkey with production durability (AOF, appendfsync always).
  ours:  python -m onlinerl_feedback (join + reward + one atomic Lua append, group-committed pipelines)
  naive: FastAPI + pydantic body, then one synchronous XADD per request (no auth, no join, no dedupe)
Audit after every slice, by event id: wrk writes the id of every reply whose ``status`` is
``accepted_for_training`` (naive: every 200); each must be exactly one entry of the samples stream (``lost``: acked,
not in the stream; ``double``: extra entries of one id). Duplicate replies are counted on their own, never as trained.

    .venv/bin/python bench/feedback_load.py --duration 15 --connections 16,64,128
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import platform
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import orjson
import redis
import yaml
from baseline import checkout_of  # bench/ is sys.path[0] when run as a script
from proc_cpu import cpu_seconds, tree_cpu_seconds

from onlinerl.auth import write_keys_file
from onlinerl.dataplane import samples
from onlinerl.fim import get_template
from onlinerl.keys import Keys
from onlinerl.procs import Child, python_module
from onlinerl.schemas import CompletionOutcome
from onlinerl.valkey import EmbeddedValkey, free_port

JOB = "bench"
TENANT = "acme"
# Many users, as in production: one user's contributions are capped per hour (feedback.limits), and a slice posts
# tens of thousands of events. Request n uses key n % USERS and template n % --prompts: USERS is prime, so every user
# sees every template and has the tenant's accept rate (a user always given the same templates would accept 0% or
# 100% of them, and the anomaly test would quarantine them).
USERS = 251
API_KEYS = [f"bench-key-acme-{i:03d}" for i in range(USERS)]
NAIVE_JOB_SUFFIX = "-naive"  # the naive baseline writes the samples stream of a job of its own

WRK_SCRIPT = r"""
-- Request n (0-based, one wrk thread) rates rollout n of this slice: template n % #templates, with "__ID__"
-- (completionId) and "__N__" (in prefix and prompt) both replaced by "<slice>-<n>".
local bodies, headers, counter, acked, mode = {}, {}, 0, nil, "accepted"
-- globals: done() reads them with thread:get. trained = status accepted_for_training (naive: any 200).
ok, other, trained, duplicate, unmatched, rejected = 0, 0, 0, 0, 0, 0
local threads = {}
function setup(thread) thread:set("id", #threads + 1); table.insert(threads, thread) end
function init(args)
  for line in io.lines(args[1]) do bodies[#bodies + 1] = line end
  run = args[4]
  acked = io.open(args[5], "w")
  mode = args[6]
  wrk.method = "POST"
  for key in io.lines(args[2]) do  -- one API key (user) per line; wrk.format takes the whole header set
    headers[#headers + 1] = {["Content-Type"] = "application/json", ["Authorization"] = "Bearer " .. key,
                             ["X-Project-ID"] = args[3]}
  end
end
function request()
  local key = run .. "-" .. counter
  local body = string.gsub(bodies[(counter % #bodies) + 1], "__ID__", key, 1)
  body = string.gsub(body, "__N__", key)
  local h = headers[(counter % #headers) + 1]
  counter = counter + 1
  return wrk.format(nil, nil, h, body)
end
local function starts(body, status) return string.find(body, '{"status":"' .. status .. '"', 1, true) == 1 end
function response(status, headers, body)
  if status ~= 200 then other = other + 1; return end
  ok = ok + 1
  local counts = mode == "any" or starts(body, "accepted_for_training")
  if counts then
    trained = trained + 1
    acked:write(string.match(body, '"completion_id":"([^"]+)"') or "?", "\n")
  elseif starts(body, "duplicate") then duplicate = duplicate + 1
  elseif starts(body, "unmatched") then unmatched = unmatched + 1
  elseif starts(body, "rejected") then rejected = rejected + 1 end
end
function done(summary, latency, requests)
  local t = {ok = 0, other = 0, trained = 0, duplicate = 0, unmatched = 0, rejected = 0}
  for _, th in ipairs(threads) do
    for k, _ in pairs(t) do t[k] = t[k] + th:get(k) end
  end
  local e = summary.errors
  io.write(string.format('RESULT {"ok": %d, "other": %d, "trained": %d, "duplicate": %d, "unmatched": %d, ' ..
    '"rejected": %d, "requests": %d, "duration_us": %d, "p50_us": %d, "p90_us": %d, "p99_us": %d, ' ..
    '"p999_us": %d, "max_us": %d, "errors": %d}\n',
    t.ok, t.other, t.trained, t.duplicate, t.unmatched, t.rejected, summary.requests, summary.duration,
    latency:percentile(50), latency:percentile(90), latency:percentile(99),
    latency:percentile(99.9), latency.max, e.connect + e.read + e.write + e.timeout + e.status))
end
"""

CODE_LINES = [
    "import os",
    "import sys",
    "from pathlib import Path",
    "def load(path):",
    "    with open(path) as f:",
    "        return f.read()",
    "class Cache:",
    "    def __init__(self, size=128):",
    "        self.size = size",
    "        self.items = {}",
    "    def get(self, key):",
    "        return self.items.get(key)",
    "for i in range(10):",
    "    print(i * i)",
    "result = [x for x in data if x]",
    "if __name__ == '__main__':",
    "    main(sys.argv[1:])",
]
COMPLETIONS = [
    "    return a + b",
    "    total = sum(values)\n    return total",
    "        self.items[key] = value",
    "    raise ValueError(f'bad {name!r}')",
    "x = compute(y, z)",
    "\n    return None\n",
]


@functools.cache
def _smollm2_tokenizer():
    from tokenizers import Tokenizer

    from onlinerl.model import bootstrap_smollm2

    return Tokenizer.from_file(str(bootstrap_smollm2() / "tokenizer.json"))


def simple_tokens(text: str) -> tuple[list[int], list[int]]:
    """SmolLM2's tokens of the text (the tokenizer the service loads: it cuts by these ids' bytes) with their char
    offsets, plus EOS (id 2)."""
    enc = _smollm2_tokenizer().encode(text, add_special_tokens=False)
    return [*enc.ids, 2], [start for start, _ in enc.offsets] + [len(text)]


@dataclass(frozen=True)
class Template:
    """One Continue request and its upload, with ``__N__`` where the slice-unique cursor key goes (prefix, prompt),
    and the vLLM choice the gateway would have relayed for it."""

    request: bytes  # the client's POST /v1/completions body, as Continue sends it
    choice: dict  # vLLM's non-stream choice (text, token_ids, logprobs, prompt_token_ids, finish_reason)
    upload: dict  # the feedback upload, "__ID__" where the completionId goes


def make_templates(rng: random.Random, n: int) -> list[Template]:
    """``n`` request templates: ~10% of uploads show a prefix-cut completion, 1/3 are rejects, 1/7 cache hits."""
    qwen = get_template("qwen")
    out = []
    for i in range(n):
        prefix = "\n".join(rng.choice(CODE_LINES) for _ in range(40)) + "\n# cursor __N__\n"
        suffix = "\n".join(rng.choice(CODE_LINES) for _ in range(8))
        prompt = qwen.render(prefix, suffix)
        completion = COMPLETIONS[i % len(COMPLETIONS)]
        ids, offsets = simple_tokens(completion)
        choice = {
            "index": 0,
            "text": completion,
            "token_ids": ids,
            "prompt_token_ids": _smollm2_tokenizer().encode(prompt, add_special_tokens=False).ids,
            "logprobs": {"token_logprobs": [round(-rng.random(), 6) for _ in ids], "text_offset": offsets},
            "finish_reason": "stop",
        }
        request = {
            "model": "qwen2.5-coder",
            "prompt": prompt,
            "max_tokens": 64,
            "temperature": 0.01,  # Continue's default: sampled (not greedy), so trainable
            "stop": list(qwen.stop),
            "stream": True,
        }
        first_line = completion.split("\n")[0]
        shown = first_line if i % 10 == 9 and first_line.strip() else completion  # ~10% cut by Continue
        upload = {
            "completionId": "__ID__",
            "filepath": f"file:///repo/mod{i}.py",
            "prefix": prefix,
            "suffix": suffix,
            "prompt": prompt,
            "completion": shown,
            "modelProvider": "openai",
            "modelName": "qwen2.5-coder",
            "accepted": i % 3 != 0,
            "timestamp": "2026-11-21T12:00:00.000Z",
            "time": 812.0,
            "uniqueId": "bench-install",
            "numLines": shown.count("\n") + 1,
            "cacheHit": i % 7 == 0,
        }
        out.append(Template(orjson.dumps(request), choice, upload))
    return out


async def _write_rollouts(redis_url: str, keys: Keys, templates: list[Template], tag: str, count: int) -> None:
    """Rollouts ``<tag>-0`` .. ``<tag>-<count-1>``, built and stored by the gateway's own code (capture.py,
    requests.py); wrk's request n carries the same key, so every event rates its own, unrated rollout."""
    from redis.asyncio import Redis

    from onlinerl.arms import STABLE
    from onlinerl.config import OnlineRLConfig
    from onlinerl_serving.capture import RolloutAccumulator, RolloutStore
    from onlinerl_serving.requests import Limits, parse_completion_request, sampling_record

    limits = Limits(10**6, 10**6, 10**6)
    client = Redis.from_url(redis_url)
    store = RolloutStore(client, keys, OnlineRLConfig().redis.rollout_ttl_seconds)
    pending: list[asyncio.Future] = []
    try:
        for n in range(count):
            t = templates[n % len(templates)]
            req = parse_completion_request(t.request.replace(b"__N__", f"{tag}-{n}".encode()), limits)
            acc = RolloutAccumulator()
            acc.add_choice(t.choice)
            record = acc.to_record(
                tenant=TENANT,
                arm=STABLE,
                version=1,
                served_model="bench-v1",
                user_hash="",
                prompt=req.prompt,
                sampling=sampling_record(req),
                created_at=time.time(),
            )
            pending.append(await store.send(record))
            if len(pending) >= 1024:
                await asyncio.gather(*pending)
                pending.clear()
        await asyncio.gather(*pending)
    finally:
        await store.close()
        await client.aclose()


def write_rollouts(redis_url: str, keys: Keys, templates: list[Template], tag: str, count: int) -> float:
    """Store the slice's rollouts; returns the seconds it took (outside the measured slice)."""
    t0 = time.perf_counter()
    asyncio.run(_write_rollouts(redis_url, keys, templates, tag, count))
    return time.perf_counter() - t0


def naive_app(redis_url: str, job: str):
    """The baseline: parse with pydantic, then one synchronous XADD per request (FastAPI runs it in its threadpool)."""
    from fastapi import FastAPI

    client = redis.Redis.from_url(redis_url)
    keys = Keys(job)
    app = FastAPI()

    @app.post("/api/training/submit")
    def submit(event: CompletionOutcome) -> dict:
        entry_id = samples.add(client, keys, event.model_dump_json(by_alias=True))
        return {"status": "submitted", "completion_id": event.completion_id, "id": entry_id}

    @app.get("/healthz")
    def healthz() -> dict:
        return {"status": "ok"}

    return app


def serve_naive(port: int, redis_url: str, job: str) -> None:
    import uvicorn

    uvicorn.run(
        naive_app(redis_url, job),
        host="127.0.0.1",
        port=port,
        loop="uvloop",
        http="httptools",
        log_level="warning",
        access_log=False,
    )


def valkey_pid(port: int) -> int:
    out = subprocess.run(["pgrep", "-f", f"valkey-server 127.0.0.1:{port}"], capture_output=True, text=True).stdout
    return int(out.split()[0])


def run_wrk(
    url: str,
    script: Path,
    bodies: Path,
    api_keys: Path,
    connections: int,
    duration: int,
    run_id: str,
    acked: Path,
    mode: str,
) -> dict:
    """One closed-loop wrk run; ``acked`` receives the completionId of every counted reply (``mode``: "accepted" =
    status accepted_for_training, "any" = any 200)."""
    argv = [
        "wrk",
        "-t1",
        f"-c{connections}",
        f"-d{duration}s",
        "--timeout",
        "5s",
        "-s",
        str(script),
        url,
        "--",
        str(bodies),
        str(api_keys),
        TENANT,
        run_id,
        str(acked),
        mode,
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=duration + 60)
    if proc.returncode != 0:
        raise RuntimeError(f"wrk failed ({proc.returncode}): {proc.stderr.strip()} {proc.stdout.strip()[-2000:]}")
    out = proc.stdout
    line = next(ln for ln in out.splitlines() if ln.startswith("RESULT "))
    res = json.loads(line[len("RESULT ") :])
    res["rps"] = res["requests"] / (res["duration_us"] / 1e6)
    res["ok_rps"] = res["ok"] / (res["duration_us"] / 1e6)
    return res


def audit_stream(client: redis.Redis, keys: Keys, id_field: str) -> Counter[str]:
    """Entries per event id in the samples stream of ``keys``, read back page by page."""
    ids: Counter[str] = Counter()
    start = "-"
    while True:
        page = samples.read_all(client, keys, count=5000, start=start)
        if not page:
            return ids
        for _, data in page:
            ids[orjson.loads(data)[id_field]] += 1
        start = "(" + page[-1][0]


def wait_no_rewrite(client: redis.Redis, timeout: float = 180.0) -> None:
    """Wait until valkey runs no AOF rewrite: writing a slice's rollouts (~4 KB each) grows the AOF enough to start
    one, and its fork and disk writes would land in the measured slice."""
    deadline = time.monotonic() + timeout
    while True:
        info = client.info("persistence")
        if not info.get("aof_rewrite_in_progress") and not info.get("aof_rewrite_scheduled"):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"valkey still rewriting its AOF after {timeout:.0f} s")
        time.sleep(0.1)


def exact_audit(acked: list[str], in_stream: Counter[str]) -> dict:
    """Every acknowledged id must be exactly one stream entry. Entries nobody acknowledged are requests still in
    flight when wrk stopped (at most one per connection): written, never answered; not a loss."""
    acked_set = set(acked)
    return {
        "acked_ids": len(acked),
        "acked_repeated": len(acked) - len(acked_set),  # the same id acknowledged twice: must be 0
        "stream_entries": sum(in_stream.values()),
        "distinct_events": len(in_stream),
        "lost": len(acked_set - in_stream.keys()),
        "double_counted": sum(c - 1 for c in in_stream.values()),
        "unacked_in_stream": len(in_stream.keys() - acked_set),
    }


def server_name(workers: int) -> str:
    return "ours" if workers == 1 else f"ours-w{workers}"


def measure_slice(
    name: str,
    child: Child,
    port: int,
    keys: Keys,
    client: redis.Redis,
    vk_pid: int,
    conns: int,
    args: argparse.Namespace,
    tmp: Path,
    templates: list[Template],
    redis_url: str,
) -> dict:
    """One wrk slice against one server on fresh rollouts, then the exact audit of that slice's entries."""
    client.flushdb()  # the previous slice's rollouts, rated marks, dedupe keys and streams
    ours = name != "naive"
    tag = uuid.uuid4().hex[:8]
    rollouts = args.duration * args.rollouts_per_second if ours else 0
    setup_s = write_rollouts(redis_url, Keys(JOB), templates, tag, rollouts) if ours else 0.0
    acked_path = tmp / f"acked-{tag}.txt"
    wait_no_rewrite(client)
    forks0 = client.info("stats").get("total_forks", 0)
    cpu0, load0 = (tree_cpu_seconds(child.pid), cpu_seconds(vk_pid)), os.getloadavg()[0]
    wrk0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    res = run_wrk(
        f"http://127.0.0.1:{port}/api/training/submit",
        tmp / "submit.lua",
        tmp / "bodies.jsonl",
        tmp / "api_keys.txt",
        conns,
        args.duration,
        tag,
        acked_path,
        "accepted" if ours else "any",
    )
    wrk1 = resource.getrusage(resource.RUSAGE_CHILDREN)  # wrk is our only child that exits during a slice
    res["server_cpu_us_per_event"] = (tree_cpu_seconds(child.pid) - cpu0[0]) / res["requests"] * 1e6
    wrk_cpu = (wrk1.ru_utime + wrk1.ru_stime) - (wrk0.ru_utime + wrk0.ru_stime)
    res["wrk_cpu_us_per_event"] = wrk_cpu / res["requests"] * 1e6
    res["valkey_cpu_us_per_event"] = (cpu_seconds(vk_pid) - cpu0[1]) / res["requests"] * 1e6
    res["loadavg_1m"] = (load0, os.getloadavg()[0])
    res["valkey_forks_in_slice"] = client.info("stats").get("total_forks", 0) - forks0  # AOF rewrites: noise
    res["trained_rps"] = res["trained"] / (res["duration_us"] / 1e6)
    acked = acked_path.read_text().split()
    acked_path.unlink()
    audit = exact_audit(acked, audit_stream(client, keys, "event_id" if ours else "completionId"))
    client.flushdb()
    res.update(server=name, connections=conns, rollouts_written=rollouts, rollout_setup_s=round(setup_s, 2), **audit)
    if audit["acked_ids"] != res["trained"]:
        res["lost"] = max(res["lost"], res["trained"] - audit["acked_ids"])  # a counted reply whose id was not written
    print(
        f"{name:14s} c={conns:<4d} {res['ok_rps']:7.0f} ok/s  p50 {res['p50_us'] / 1000:6.1f} ms  "
        f"p99 {res['p99_us'] / 1000:6.1f} ms  ok={res['ok']} trained={res['trained']} dup={res['duplicate']} "
        f"unmatched={res['unmatched']} rejected={res['rejected']} other={res['other']} errors={res['errors']} "
        f"in-stream={res['stream_entries']} lost={res['lost']} double={res['double_counted']} "
        f"unacked-in-stream={res['unacked_in_stream']}  cpu/event server "
        f"{res['server_cpu_us_per_event']:.0f} us valkey {res['valkey_cpu_us_per_event']:.0f} us "
        f"wrk {res['wrk_cpu_us_per_event']:.0f} us  load {res['loadavg_1m'][1]:.1f}  (setup {setup_s:.1f} s, "
        f"valkey forks {res['valkey_forks_in_slice']})",
        flush=True,
    )
    return res


def summarize(results: list[dict]) -> list[dict]:
    """Per (server, connections): totals over the interleaved rounds, medians of the per-round percentiles."""
    out = []
    for key in dict.fromkeys((r["server"], r["connections"]) for r in results):
        rs = [r for r in results if (r["server"], r["connections"]) == key]
        secs = sum(r["duration_us"] for r in rs) / 1e6
        out.append(
            {
                "server": key[0],
                "connections": key[1],
                "rounds": len(rs),
                "ok_rps": sum(r["ok"] for r in rs) / secs,
                "ok_rps_per_round": [round(r["ok_rps"]) for r in rs],
                "p50_ms_median": statistics.median(r["p50_us"] for r in rs) / 1000,
                "p99_ms_median": statistics.median(r["p99_us"] for r in rs) / 1000,
                "p99_ms_per_round": [round(r["p99_us"] / 1000, 1) for r in rs],
                "trained_rps": sum(r["trained"] for r in rs) / secs,
                "acked": sum(r["ok"] for r in rs),
                "trained": sum(r["trained"] for r in rs),
                "duplicate": sum(r["duplicate"] for r in rs),
                "unmatched": sum(r["unmatched"] for r in rs),
                "rejected": sum(r["rejected"] for r in rs),
                "non_200": sum(r["other"] for r in rs),
                "acked_ids": sum(r["acked_ids"] for r in rs),
                "distinct_in_stream": sum(r["distinct_events"] for r in rs),
                "unacked_in_stream": sum(r["unacked_in_stream"] for r in rs),
                "lost": sum(r["lost"] for r in rs),
                "double_counted": sum(r["double_counted"] for r in rs),
                "server_cpu_us_per_event": statistics.median(r["server_cpu_us_per_event"] for r in rs),
                "valkey_cpu_us_per_event": statistics.median(r["valkey_cpu_us_per_event"] for r in rs),
                "wrk_cpu_us_per_event": statistics.median(r["wrk_cpu_us_per_event"] for r in rs),
                "loadavg_1m_range": (min(min(r["loadavg_1m"]) for r in rs), max(max(r["loadavg_1m"]) for r in rs)),
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=int, default=8, help="seconds per wrk slice")
    p.add_argument("--rounds", type=int, default=3, help="interleaved ours/naive slices per connection count")
    p.add_argument("--connections", default="8,32,128", help="comma-separated wrk connection counts")
    p.add_argument("--prompts", type=int, default=256, help="distinct request templates (each slice-unique per event)")
    p.add_argument(
        "--rollouts-per-second",
        type=int,
        default=8000,
        help="rollouts written before each slice, per second of --duration: more than a slice can post, so every "
        "event rates its own rollout (a request past them is reported as unmatched)",
    )
    p.add_argument("--skip-naive", action="store_true")
    p.add_argument("--workers", default="1", help="comma-separated feedback.workers values, each its own server")
    p.add_argument(
        "--baseline-ref",
        default="",
        help="also run the feedback service of these git commits (comma-separated; one worker each), interleaved: "
        "before/after in one run",
    )
    p.add_argument("--out", default="", help="write the results as JSON here")
    p.add_argument("--serve-naive", nargs=3, metavar=("PORT", "REDIS_URL", "JOB"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve_naive:
        serve_naive(int(args.serve_naive[0]), args.serve_naive[1], args.serve_naive[2])
        return 0
    if shutil.which("wrk") is None:
        print("wrk not found: `apt-get install wrk` (Debian package, C load generator)", file=sys.stderr)
        return 2

    keys = Keys(JOB)
    worker_counts = [int(w) for w in args.workers.split(",")]
    # Every variant of ours writes the job's samples stream; slices run one at a time and each empties it first.
    streams = {server_name(w): keys for w in worker_counts}
    if not args.skip_naive:
        streams["naive"] = Keys(JOB + NAIVE_JOB_SUFFIX)
    results: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="feedback-bench-") as tmp_s:
        tmp = Path(tmp_s)
        templates = make_templates(random.Random(0), args.prompts)
        (tmp / "bodies.jsonl").write_bytes(b"\n".join(orjson.dumps(t.upload) for t in templates) + b"\n")
        (tmp / "submit.lua").write_text(WRK_SCRIPT)
        keys_file = write_keys_file(tmp / "keys.yaml", {TENANT: list(API_KEYS)})
        (tmp / "api_keys.txt").write_text("\n".join(API_KEYS) + "\n")
        cfg = {
            "job": JOB,
            "model": {"fimTemplate": "qwen"},
            "auth": {"apiKeysFile": str(keys_file)},
            "feedback": {"maxBacklog": 100_000_000},
        }
        (tmp / "config.yaml").write_text(yaml.safe_dump(cfg))
        with EmbeddedValkey(tmp / "valkey") as vk:
            client = redis.Redis.from_url(vk.url)
            vk_pid = valkey_pid(vk.port)
            ports = {name: free_port() for name in streams}
            argvs = {
                server_name(w): python_module(
                    "onlinerl_feedback",
                    *("--port", str(ports[server_name(w)]), "--host", "127.0.0.1", "--redis-url", vk.url),
                    *("--workers", str(w)),
                )
                for w in worker_counts
            }
            argvs["naive"] = [
                sys.executable,
                str(Path(__file__).resolve()),
                *("--serve-naive", str(ports.get("naive")), vk.url, JOB + NAIVE_JOB_SUFFIX),
            ]
            env = {name: {"ONLINERL_CONFIG": str(tmp / "config.yaml")} for name in ports}
            cwd: dict[str, str] = {}
            for ref in filter(None, args.baseline_ref.split(",")):
                # the same service at an older commit: sys.path[0] is the cwd under `python -m`
                name = f"ours@{ref}"
                path = checkout_of(
                    ref,
                    tmp / f"baseline-{ref}",
                    {"onlinerl": "onlinerl", "onlinerl_feedback": "services/feedback"},
                )
                ports[name] = free_port()
                argvs[name] = python_module(
                    "onlinerl_feedback", "--port", str(ports[name]), "--host", "127.0.0.1", "--redis-url", vk.url
                )
                env[name] = {"ONLINERL_CONFIG": str(tmp / "config.yaml"), "PYTHONPATH": str(path)}
                cwd[name] = str(path)
                streams[name] = keys
            children: dict[str, Child] = {}
            try:
                for name, port in ports.items():  # all stay up; slices alternate so load drift hits all alike
                    children[name] = Child(
                        name, argvs[name], tmp / f"{name}.log", env=env[name], cwd=cwd.get(name)
                    ).start()
                    children[name].wait_healthy(f"http://127.0.0.1:{port}/healthz", timeout=60)
                for conns in [int(c) for c in args.connections.split(",")]:
                    for _ in range(args.rounds):
                        for name, child in children.items():
                            results.append(
                                measure_slice(
                                    name,
                                    child,
                                    ports[name],
                                    streams[name],
                                    client,
                                    vk_pid,
                                    conns,
                                    args,
                                    tmp,
                                    templates,
                                    vk.url,
                                )
                            )
            finally:
                for child in children.values():
                    child.stop()
                client.close()
    summary = summarize(results)
    for s in summary:
        print(
            f"SUMMARY {s['server']:14s} c={s['connections']:<4d} {s['ok_rps']:6.0f} ok/s (rounds "
            f"{s['ok_rps_per_round']})  trained {s['trained_rps']:.0f}/s  p50 {s['p50_ms_median']:.1f} ms  "
            f"p99 {s['p99_ms_median']:.1f} ms  dup {s['duplicate']}  unmatched {s['unmatched']}  "
            f"lost {s['lost']}  double {s['double_counted']}  cpu/event {s['server_cpu_us_per_event']:.0f} us + "
            f"valkey {s['valkey_cpu_us_per_event']:.0f} us + wrk {s['wrk_cpu_us_per_event']:.0f} us  "
            f"load {s['loadavg_1m_range']}"
        )
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores",
        "duration_s": args.duration,
        "rounds": args.rounds,
        "summary": summary,
        "slices": results,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(meta, indent=2))
    exact = all(r["lost"] == 0 and r["double_counted"] == 0 and r["acked_repeated"] == 0 for r in results)
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
