"""Sustained-load benchmark of the feedback service, against a naive baseline, with a lost-event audit.

Load generator: wrk (Debian package ``wrk``, C + LuaJIT, one thread) so the generator costs little of the 2 shared
cores; every request carries a unique ``completionId`` and a realistic Continue upload (~2 KB: rendered Qwen FIM
prompt, prefix, suffix) joined to a rollout record written beforehand exactly as the gateway does.
wrk is closed-loop (N connections, each sends its next request when the previous answered), so the figures are the
throughput at that concurrency and the latency those requests saw.

Both servers run against the same embedded valkey with production durability (AOF, appendfsync always).
  ours:  python -m onlinerl_feedback (join + reward + one atomic Lua append, group-committed pipelines)
  naive: FastAPI + pydantic body, then one synchronous XADD per request (no auth, no join, no dedupe)
After each run the stream is read back: every 200 must be one distinct entry (zero lost, zero double-counted).

    .venv/bin/python bench/feedback_load.py --duration 15 --connections 16,64,128
"""

from __future__ import annotations

import argparse
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
import zlib
from pathlib import Path

import orjson
import redis
import yaml
from baseline import checkout_of  # bench/ is sys.path[0] when run as a script
from proc_cpu import cpu_seconds, tree_cpu_seconds

from onlinerl.auth import write_keys_file
from onlinerl.fim import get_template
from onlinerl.keys import Keys
from onlinerl.procs import Child, python_module
from onlinerl.schemas import CompletionOutcome, RolloutRecord
from onlinerl.valkey import EmbeddedValkey, free_port

JOB = "bench"
TENANT, API_KEY = "acme", "bench-key-acme"
NAIVE_STREAM_SUFFIX = "naive-samples"

WRK_SCRIPT = r"""
local bodies, counter = {}, 0
ok, other, trained = 0, 0, 0  -- globals: done() reads them with thread:get
local threads = {}
function setup(thread) thread:set("id", #threads + 1); table.insert(threads, thread) end
function init(args)
  for line in io.lines(args[1]) do bodies[#bodies + 1] = line end
  run = args[4]
  wrk.method = "POST"
  wrk.headers["Content-Type"] = "application/json"
  wrk.headers["Authorization"] = "Bearer " .. args[2]
  wrk.headers["X-Project-ID"] = args[3]
end
function request()
  counter = counter + 1
  local body = string.gsub(bodies[(counter % #bodies) + 1], "__ID__", run .. "-" .. id .. "-" .. counter, 1)
  return wrk.format(nil, nil, nil, body)
end
function response(status, headers, body)
  if status == 200 then ok = ok + 1 else other = other + 1 end
  if status == 200 and string.find(body, "accepted_for_training", 1, true) then trained = trained + 1 end
end
function done(summary, latency, requests)
  local ok_total, other_total, trained_total = 0, 0, 0
  for _, t in ipairs(threads) do
    ok_total = ok_total + t:get("ok"); other_total = other_total + t:get("other")
    trained_total = trained_total + t:get("trained")
  end
  local e = summary.errors
  io.write(string.format('RESULT {"ok": %d, "other": %d, "trained": %d, "requests": %d, "duration_us": %d, ' ..
    '"p50_us": %d, "p90_us": %d, "p99_us": %d, "p999_us": %d, "max_us": %d, "errors": %d}\n',
    ok_total, other_total, trained_total, summary.requests, summary.duration,
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


def make_corpus(rng: random.Random, n: int) -> list[tuple[RolloutRecord, dict]]:
    """``n`` rollouts and, for each, a Continue upload template (``__ID__`` where the completionId goes)."""
    qwen = get_template("qwen")
    out = []
    for i in range(n):
        prefix = "\n".join(rng.choice(CODE_LINES) for _ in range(40)) + f"\n# cursor {i}\n"
        suffix = "\n".join(rng.choice(CODE_LINES) for _ in range(8))
        prompt = qwen.render(prefix, suffix)
        completion = COMPLETIONS[i % len(COMPLETIONS)]
        ids, offsets = simple_tokens(completion)
        prompt_ids = [1000 + (zlib.crc32(w.encode()) % 40000) for w in prompt.split()]
        rec = RolloutRecord(
            rollout_id=f"cmpl-{i}",
            tenant=TENANT,
            policy_version=1,
            served_model="bench-v1",
            prompt=prompt,
            prompt_token_ids=prompt_ids,
            completion=completion,
            completion_token_ids=ids,
            behaviour_logprobs=[round(-rng.random(), 6) for _ in ids],
            token_offsets=offsets,
        )
        first_line = completion.split("\n")[0]
        shown = first_line if i % 10 == 9 and first_line.strip() else completion  # ~10% cut by Continue
        body = {
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
        out.append((rec, body))
    return out


def naive_app(redis_url: str, stream: str):
    """The baseline: parse with pydantic, then one synchronous XADD per request (FastAPI runs it in its threadpool)."""
    from fastapi import FastAPI

    client = redis.Redis.from_url(redis_url)
    app = FastAPI()

    @app.post("/api/training/submit")
    def submit(event: CompletionOutcome) -> dict:
        entry_id = client.xadd(stream, {"data": event.model_dump_json(by_alias=True)})
        return {"status": "submitted", "id": entry_id.decode()}

    @app.get("/healthz")
    def healthz() -> dict:
        return {"status": "ok"}

    return app


def serve_naive(port: int, redis_url: str, stream: str) -> None:
    import uvicorn

    uvicorn.run(
        naive_app(redis_url, stream),
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


def run_wrk(url: str, script: Path, bodies: Path, connections: int, duration: int, run_id: str) -> dict:
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
        API_KEY,
        TENANT,
        run_id,
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


def audit_stream(client: redis.Redis, stream: str, id_field: str) -> tuple[int, int]:
    """(entries, distinct event ids) in ``stream``, read back page by page."""
    seen: set[str] = set()
    entries, start = 0, "-"
    while True:
        page = client.xrange(stream, min=start, count=5000)
        if not page:
            return entries, len(seen)
        for _, fields in page:
            seen.add(orjson.loads(fields[b"data"])[id_field])
            entries += 1
        start = "(" + page[-1][0].decode()


def server_name(workers: int) -> str:
    return "ours" if workers == 1 else f"ours-w{workers}"


def measure_slice(
    name: str,
    child: Child,
    port: int,
    stream: str,
    client: redis.Redis,
    vk_pid: int,
    conns: int,
    args: argparse.Namespace,
    tmp: Path,
) -> dict:
    """One wrk slice against one server, then the lost-event audit of exactly that slice's entries."""
    client.delete(stream)
    cpu0, load0 = (tree_cpu_seconds(child.pid), cpu_seconds(vk_pid)), os.getloadavg()[0]
    wrk0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    res = run_wrk(
        f"http://127.0.0.1:{port}/api/training/submit",
        tmp / "submit.lua",
        tmp / "bodies.jsonl",
        conns,
        args.duration,
        uuid.uuid4().hex[:8],
    )
    wrk1 = resource.getrusage(resource.RUSAGE_CHILDREN)  # wrk is our only child that exits during a slice
    res["server_cpu_us_per_event"] = (tree_cpu_seconds(child.pid) - cpu0[0]) / res["requests"] * 1e6
    wrk_cpu = (wrk1.ru_utime + wrk1.ru_stime) - (wrk0.ru_utime + wrk0.ru_stime)
    res["wrk_cpu_us_per_event"] = wrk_cpu / res["requests"] * 1e6
    res["valkey_cpu_us_per_event"] = (cpu_seconds(vk_pid) - cpu0[1]) / res["requests"] * 1e6
    res["loadavg_1m"] = (load0, os.getloadavg()[0])
    ours = name != "naive"
    entries, distinct = audit_stream(client, stream, "event_id" if ours else "completionId")
    client.delete(stream)
    # ours answers 200 for audited events too; only accepted_for_training ones belong in samples.
    expected = res["trained"] if ours else res["ok"]
    res.update(
        server=name,
        connections=conns,
        stream_entries=entries,
        distinct_events=distinct,
        expected_in_stream=expected,
        lost=max(0, expected - distinct),
        double_counted=entries - distinct,
    )
    print(
        f"{name:14s} c={conns:<4d} {res['ok_rps']:7.0f} ok/s  p50 {res['p50_us'] / 1000:6.1f} ms  "
        f"p99 {res['p99_us'] / 1000:6.1f} ms  ok={res['ok']} other={res['other']} errors={res['errors']} "
        f"expected={expected} in-stream={entries} lost={res['lost']}  cpu/event server "
        f"{res['server_cpu_us_per_event']:.0f} us valkey {res['valkey_cpu_us_per_event']:.0f} us "
        f"wrk {res['wrk_cpu_us_per_event']:.0f} us  "
        f"load {res['loadavg_1m'][1]:.1f}",
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
                "acked": sum(r["ok"] for r in rs),
                "expected_in_stream": sum(r["expected_in_stream"] for r in rs),
                "distinct_in_stream": sum(r["distinct_events"] for r in rs),
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
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--skip-naive", action="store_true")
    p.add_argument("--workers", default="1", help="comma-separated feedback.workers values, each its own server")
    p.add_argument(
        "--baseline-ref",
        default="",
        help="also run the feedback service of this git commit (one worker), interleaved: before/after in one run",
    )
    p.add_argument("--out", default="", help="write the results as JSON here")
    p.add_argument("--serve-naive", nargs=3, metavar=("PORT", "REDIS_URL", "STREAM"), help=argparse.SUPPRESS)
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
    streams = {server_name(w): keys.samples for w in worker_counts}
    if not args.skip_naive:
        streams["naive"] = keys.prefix + NAIVE_STREAM_SUFFIX
    results: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="feedback-bench-") as tmp_s:
        tmp = Path(tmp_s)
        corpus = make_corpus(random.Random(0), args.prompts)
        (tmp / "bodies.jsonl").write_bytes(b"\n".join(orjson.dumps(b) for _, b in corpus) + b"\n")
        (tmp / "submit.lua").write_text(WRK_SCRIPT)
        keys_file = write_keys_file(tmp / "keys.yaml", {TENANT: [API_KEY]})
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
            for rec, _ in corpus:
                client.hset(keys.rollouts(rec.tenant, rec.prompt), rec.rollout_id, rec.to_json())
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
                *("--serve-naive", str(ports.get("naive")), vk.url, streams.get("naive", "")),
            ]
            env = {name: {"ONLINERL_CONFIG": str(tmp / "config.yaml")} for name in ports}
            cwd: dict[str, str] = {}
            if args.baseline_ref:  # the same service at an older commit: sys.path[0] is the cwd under `python -m`
                name = f"ours@{args.baseline_ref}"
                path = checkout_of(
                    args.baseline_ref,
                    tmp / "baseline",
                    {"onlinerl": "onlinerl", "onlinerl_feedback": "services/feedback"},
                )
                ports[name] = free_port()
                argvs[name] = python_module(
                    "onlinerl_feedback", "--port", str(ports[name]), "--host", "127.0.0.1", "--redis-url", vk.url
                )
                env[name] = {"ONLINERL_CONFIG": str(tmp / "config.yaml"), "PYTHONPATH": str(path)}
                cwd[name] = str(path)
                streams[name] = keys.samples
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
                                measure_slice(name, child, ports[name], streams[name], client, vk_pid, conns, args, tmp)
                            )
            finally:
                for child in children.values():
                    child.stop()
                client.close()
    summary = summarize(results)
    for s in summary:
        print(
            f"SUMMARY {s['server']:14s} c={s['connections']:<4d} {s['ok_rps']:6.0f} ok/s (rounds "
            f"{s['ok_rps_per_round']})  p50 {s['p50_ms_median']:.1f} ms  p99 {s['p99_ms_median']:.1f} ms  "
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
    return 0 if all(r["lost"] == 0 and r["double_counted"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
