"""What the capture's ``logprobs: 0`` costs vLLM in CPU time, split by process: API server and engine core.

CPU time (utime + stime from /proc) per request does not grow with a busy box the way wall time does, so it splits
the cost where noisy wall-clock figures cannot. Starts vLLM on the tiny model (as bench/serving_latency.py does),
sends the same Continue-shaped request with and without ``logprobs: 0``, interleaved, and prints the CPU each
process spent per request. ``--without-plugin`` starts vLLM without onlinerl's vLLM plugin
(services/serving/onlinerl_serving/vllm_plugin.py): run it once each way for before/after.

    .venv/bin/python bench/capture_cpu.py -n 150
    .venv/bin/python bench/capture_cpu.py -n 150 --without-plugin
    .venv/bin/python bench/capture_cpu.py -n 150 --count-rank      # the plugin as before it skipped the rank
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import httpx
import orjson
from proc_cpu import cpu_seconds, tree_pids  # bench/ is sys.path[0] when run as a script
from serving_latency import body, others_than_ours

from onlinerl.config import from_mapping
from onlinerl.valkey import free_port

JSON = {"content-type": "application/json"}
VARIANTS = {"none": {}, "logprobs 0": {"logprobs": 0}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=150, help="requests per variant and mode")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--without-plugin", action="store_true")
    ap.add_argument("--count-rank", action="store_true", help="the plugin counts the rank again (vLLM's value)")
    args = ap.parse_args()

    from onlinerl.model import bootstrap_smollm2, default_cache_dir, make_tiny_model
    from onlinerl_serving.engine import start_vllm

    model = make_tiny_model(default_cache_dir() / "models" / "tiny-llama-2l", bootstrap_smollm2())
    port = free_port()
    env = {"VLLM_PLUGINS": others_than_ours()} if args.without_plugin else {}
    if args.count_rank:
        from onlinerl_serving.vllm_plugin import COUNT_RANK_ENV

        env[COUNT_RANK_ENV] = "1"
    tmp = Path(tempfile.mkdtemp(prefix="orl-capture-cpu-"))
    child = start_vllm(
        from_mapping({"model": {"maxModelLen": 2048}}), model, tmp / "vllm.log", port=port, extra_env=env
    )
    try:
        api = child.pid
        engine = sorted(tree_pids(api) - {api})  # the engine core (and any helper process it started)
        url = f"http://127.0.0.1:{port}/v1/completions"
        with httpx.Client(timeout=120) as client:
            for stream in (False, True):
                spent = {name: [0.0, 0.0, 0.0] for name in VARIANTS}  # api cpu, engine cpu, wall
                payloads = {name: orjson.dumps({**body(stream, args.max_tokens), **x}) for name, x in VARIANTS.items()}
                for payload in payloads.values():  # warm-up
                    for _ in range(5):
                        client.post(url, content=payload, headers=JSON).raise_for_status()
                for _ in range(args.n):
                    for name, payload in payloads.items():
                        a0, e0, t0 = cpu_seconds(api), sum(map(cpu_seconds, engine)), time.perf_counter()
                        with client.stream("POST", url, content=payload, headers=JSON) as r:
                            r.raise_for_status()
                            for _ in r.iter_raw():
                                pass
                        t1 = time.perf_counter()
                        spent[name][0] += cpu_seconds(api) - a0
                        spent[name][1] += sum(map(cpu_seconds, engine)) - e0
                        spent[name][2] += t1 - t0
                print(f"{'stream' if stream else 'non-stream'} (plugin {'off' if args.without_plugin else 'on'}):")
                for name, (a, e, w) in spent.items():
                    n = args.n
                    print(
                        f"  {name:11s} API server CPU {a / n * 1e3:6.2f} ms  engine core CPU {e / n * 1e3:6.2f} ms  "
                        f"wall {w / n * 1e3:6.2f} ms"
                    )
    finally:
        child.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
