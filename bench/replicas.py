"""Serving with 1 and with 2 local replicas, in one run: the gateway's added latency and the policy-switch time.

Each phase starts the serving part of `onlinerl up` (``start_stack(..., serving_only=True)``: valkey, N x (vLLM +
gateway + reloader), and with N = 2 the balancer) on the tiny random model (tests/conftest.py), ``rollout.strategy:
direct``, then:
  latency   sequential requests, non-stream and stream, interleaved round-robin over the paths (so machine noise
            hits all alike): ``direct`` (replica 0's vLLM, the client's body), ``gateway`` (replica 0's own gateway)
            and, with N = 2, ``front`` (the balancer on the configured port, in front of both gateways); p50/p95 of
            the totals, time to the first text event, and the paired median of (path - direct) per round;
  switch    for v1..vK: XADD the announcement (the trainer's last publishing step) -> the policy table's stable is vK
            (every live replica has loaded it; polled every 5 ms): the time users wait for a new version.

    .venv/bin/python bench/replicas.py                  # -n 120 requests per path, 3 switches per phase
    .venv/bin/python bench/replicas.py -n 200 --switches 4 --json bench/results/replicas.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.serving.lora_helpers: checkpoints written exactly as the trainer writes them

from onlinerl.config import from_mapping  # noqa: E402
from onlinerl.dataplane import policy  # noqa: E402
from onlinerl.keys import Keys  # noqa: E402
from onlinerl.loop.stack import LocalPorts, Stack, start_stack  # noqa: E402
from onlinerl.valkey import free_port  # noqa: E402
from tests.serving.lora_helpers import announce, write_lora_checkpoint  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
import serving_latency  # noqa: E402  (one request body and one timer for both latency benchmarks)
from affinity import isolate_engines  # noqa: E402
from latency_stats import bar_table, paired_median, pct  # noqa: E402
from proc_cpu import tree_pids  # noqa: E402

JOB = "bench"


def start(n: int, state: Path, model: Path, ckpt: Path, gateway_mode: str = "sidecar") -> Stack:
    cfg = from_mapping(
        {
            "job": JOB,
            "model": {"path": str(model), "maxModelLen": 1024},
            "serving": {
                "host": "127.0.0.1",
                "port": free_port(),
                "engineUrl": f"http://127.0.0.1:{free_port()}",  # beside a running stack on the default ports
                "replicas": n,
                "gatewayMode": gateway_mode,
            },
            "rollout": {"strategy": "direct"},
            "storage": {"checkpointDir": str(ckpt)},
        }
    )
    ports = LocalPorts(redis=free_port(), reloader=free_port(), rollout=free_port(), replica_base=0)
    return start_stack(cfg, state, build_data=False, ports=ports, serving_only=True, on_step=lambda m: None)


def latency(
    stack: Stack, n: int, warmup: int, max_tokens: int, gap_s: float = 0.0
) -> dict[str, dict[str, list[float]]]:
    """Per path: non-stream total, stream TTFT (first event with text) and stream total, requests interleaved.
    Every path sends the same Continue-shaped body at the gateway's exploration temperature (serving_latency.body):
    at temperature 0 vLLM alone decoded other text than the gateway served (bench/RESULTS.md, 2026-11-28).

    With N > 1, ``front`` (the balancer) is timed in a block of its own, against ``direct`` again: interleaved with
    the others, its request to the other replica was still finishing (that replica's record reply, the balancer's
    teardown) when the next path's request started, and in alternating order that next path was always ``gateway``
    (bench/RESULTS.md, 2026-12-05)."""
    rep = stack.replicas[0]
    auth = {"content-type": "application/json", "authorization": f"Bearer {stack.api_key}"}
    plain = {"content-type": "application/json"}
    engine = f"http://127.0.0.1:{rep.engine}/v1/completions"
    paths = [
        ("direct", engine, plain, False),
        ("direct+cap", engine, plain, True),  # the body the gateway sends vLLM: the gateway's own share is over it
        ("gateway", f"{rep.gateway_url}/v1/completions", auth, False),
    ]
    served = stack.cfg.model.served_name
    bodies = {
        (stream, cap): serving_latency.payload(stream, max_tokens, cap, served)
        for stream in (False, True)
        for cap in (False, True)
    }

    def timed(chosen: list[tuple[str, str, dict, bool]]) -> dict[str, dict[str, list[float]]]:
        by_mode = {
            stream: [(name, url, bodies[stream, cap], headers) for name, url, headers, cap in chosen]
            for stream in (False, True)
        }
        return serving_latency.interleave(by_mode, n, warmup, gap_s)

    out = timed(paths)
    if len(stack.replicas) > 1:
        front = ("front", f"http://127.0.0.1:{stack.cfg.serving.port}/v1/completions", auth, False)
        block = timed([paths[0], front])
        out["front"] = block["front"]
        out["direct (front block)"] = block["direct"]
    return out


def switch_times(stack: Stack, paths: dict[int, Path], first: int, count: int) -> list[float]:
    """Seconds from each announcement to the table's stable being that version."""
    r = redis.Redis.from_url(stack.valkey.url)
    keys = Keys(JOB)
    out = []
    try:
        for v in range(first, first + count):
            t0 = time.perf_counter()
            announce(r, JOB, v, paths[v])
            deadline = t0 + 300
            while policy.read(r, keys).stable != v:
                if time.perf_counter() > deadline:
                    raise TimeoutError(f"v{v} not stable after 300 s (logs: {stack.paths.logs})")
                time.sleep(0.005)
            out.append(time.perf_counter() - t0)
    finally:
        r.close()
    return out


def cpu_seconds(stack: Stack) -> dict[str, float]:
    """CPU seconds (user + system) each child of the stack, with its own children, has used so far: read before and
    after the latency phase, it says which process paid for the measured requests (CPU time is not inflated by a
    noisy box, wall time is)."""
    import psutil

    out = {}
    for child in stack.children:
        try:
            procs = [psutil.Process(child.pid)]
            procs += procs[0].children(recursive=True)
            out[child.name] = sum(sum(p.cpu_times()[:2]) for p in procs)
        except psutil.NoSuchProcess:
            continue
    return out


def stack_pids(stack: Stack) -> set[int]:
    """Every process of the stack (each child with its descendants, valkey-server) and this benchmark's own."""
    pids = {os.getpid()}
    if stack.valkey is not None and stack.valkey.process is not None:
        pids.add(stack.valkey.process.pid)
    for child in stack.children:
        pids |= tree_pids(child.pid)
    return pids


def report(results: dict) -> str:
    rows = [
        "| replicas | path | non-stream total p50 ms | added vs direct ms | vs direct+cap ms | stream total p50 ms | "
        "p95 ms | added vs direct ms | vs direct+cap ms | TTFT p50 ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for n, res in results["latency"].items():
        for name, m in res.items():
            if name == "direct (front block)":
                continue
            direct, cap = res["direct"], res.get("direct+cap", res["direct"])
            if name == "front" and "direct (front block)" in res:  # timed in its own block, against direct there
                direct = cap = res["direct (front block)"]
            added_ns = paired_median(m["total"], direct["total"]) * 1e3
            over_cap_ns = paired_median(m["total"], cap["total"]) * 1e3
            added = paired_median(m["stream_total"], direct["stream_total"]) * 1e3
            over_cap = paired_median(m["stream_total"], cap["stream_total"]) * 1e3
            rows.append(
                f"| {n} | {name} | {pct(m['total'], 0.5) * 1e3:.2f} | {added_ns:+.2f} | {over_cap_ns:+.2f} | "
                f"{pct(m['stream_total'], 0.5) * 1e3:.2f} | {pct(m['stream_total'], 0.95) * 1e3:.2f} | {added:+.2f} | "
                f"{over_cap:+.2f} | {pct(m['ttft'], 0.5) * 1e3:.2f} |"
            )
    rows += ["", *bar_table(results["latency"])]
    for n, placed in results.get("affinity", {}).items():  # --engine-cores-alone
        rows.append(
            f"\n{n} replica(s): each engine alone on its core {placed['engine_cores']} ({placed['threads'][0]} "
            f"threads), every other thread of the stack and of the benchmark on {placed['host_cores']} "
            f"({placed['threads'][1]})."
        )
    if results.get("cpu_s"):
        rows += ["", "| replicas | CPU seconds each process used in the latency phase |", "|---|---|"]
        for n, used in results["cpu_s"].items():
            rows.append(f"| {n} | {', '.join(f'{k} {v:.2f}' for k, v in sorted(used.items()))} |")
    rows += ["", "| replicas | announce -> table switched, s (each switch) | median s |", "|---|---|---|"]
    for n, times in results["switch"].items():
        rows.append(f"| {n} | {', '.join(f'{t:.2f}' for t in times)} | {statistics.median(times):.2f} |")
    lat, sw = results["latency"], results["switch"]
    if "1" in lat and "2" in lat:
        g1 = paired_median(lat["1"]["gateway"]["stream_total"], lat["1"]["direct"]["stream_total"])
        g2 = paired_median(lat["2"]["gateway"]["stream_total"], lat["2"]["direct"]["stream_total"])
        front_direct = lat["2"].get("direct (front block)", lat["2"]["direct"])
        f2 = paired_median(lat["2"]["front"]["stream_total"], front_direct["stream_total"])
        rows += [
            "",
            f"Ratios (same run): gateway-added latency 2 replicas / 1 = {g2 / g1:.2f}; "
            f"through the balancer / gateway alone (2 replicas) = {f2 / g2:.2f}; "
            f"switch time 2 replicas / 1 = {statistics.median(sw['2']) / statistics.median(sw['1']):.2f}.",
        ]
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=120, help="measured requests per path and phase")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--switches", type=int, default=3, help="versions announced per phase")
    ap.add_argument("--replicas", default="1,2", help="phases, in order")
    ap.add_argument("--json", type=Path, default=None, help="write the raw figures here")
    ap.add_argument(
        "--gap-ms",
        type=float,
        default=0.0,
        help="pause before each request (serving_latency.interleave): what one server does after its response "
        "then never lands on the next request",
    )
    ap.add_argument(
        "--gateway-mode",
        choices=("sidecar", "inProcess"),
        default="sidecar",
        help="serving.gatewayMode of every phase: the gateway as its own process, or inside vLLM's",
    )
    ap.add_argument(
        "--engine-cores-alone",
        action="store_true",
        help="after each phase starts, give each vLLM engine process a core of its own and move every other thread "
        "of the stack and of this benchmark off those cores (bench/affinity.py): host work no longer stalls a "
        "generation, as on a GPU (needs more cores than replicas)",
    )
    ap.add_argument("--report", type=Path, default=None, help="print the report of a --json file, measure nothing")
    args = ap.parse_args()
    if args.report is not None:
        print(report(json.loads(args.report.read_text())))
        return 0

    from onlinerl.model import bootstrap_smollm2, default_cache_dir, make_tiny_model

    model = make_tiny_model(default_cache_dir() / "models" / "tiny-llama-2l", bootstrap_smollm2())
    phases = [int(x) for x in args.replicas.split(",")]
    results: dict = {
        "started": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, {platform.python_version()}",
        "args": vars(args) | {"json": str(args.json)},
        "latency": {},
        "switch": {},
        "load_1m": [],
    }
    with tempfile.TemporaryDirectory(prefix="bench-replicas-") as tmp:
        ckpt = Path(tmp) / "ckpt"
        paths = {v: write_lora_checkpoint(JOB, model, ckpt, v) for v in range(1, args.switches + 1)}
        for n in phases:
            print(f"phase: {n} replica(s): starting", file=sys.stderr, flush=True)
            stack = start(n, Path(tmp) / f"state-{n}", model, ckpt, args.gateway_mode)
            try:
                if args.engine_cores_alone:
                    results.setdefault("affinity", {})[str(n)] = isolate_engines(stack_pids(stack))
                    print(f"phase: {n} replica(s): {results['affinity'][str(n)]}", file=sys.stderr, flush=True)
                results["load_1m"].append(os.getloadavg()[0])
                before = cpu_seconds(stack)
                results["latency"][str(n)] = latency(stack, args.n, args.warmup, args.max_tokens, args.gap_ms / 1e3)
                after = cpu_seconds(stack)
                results.setdefault("cpu_s", {})[str(n)] = {k: after[k] - before[k] for k in after if k in before}
                results["switch"][str(n)] = switch_times(stack, paths, 1, args.switches)
                results["load_1m"].append(os.getloadavg()[0])
            finally:
                stack.stop()
    results["ended"] = datetime.now(UTC).isoformat(timespec="seconds")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))
    print(f"{results['started']} .. {results['ended']}; {results['machine']}; load 1m {results['load_1m']}")
    print(report(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
