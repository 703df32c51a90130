"""What ``logprobs: 0`` costs vLLM without HTTP, without the gateway and without a second process (issue 40).

``vllm.LLM`` on the tiny model in this one process (engine core in-process), with the server's flags that shape the
sampler (``--logprobs-mode processed_logprobs``, LoRA on, the uni executor, float32), generates the same 16 tokens at
the serving temperature with and without ``logprobs=0``, interleaved, and prints the paired median difference in wall
time and the CPU time of each. What remains in that difference is vLLM's own per-token log-probs path: the
sampler's gather, the tensors turned into lists, the output processor's ``Logprob`` objects and strings.
``--token-strings`` installs onlinerl_serving.vllm_token_strings first and fills its table with the vocabulary, as
the in-process gateway does at its start. ``--in-place`` also times the functions on the log-probs path where they
run (perf_counter around vLLM's own functions, summed per request): the wall-clock difference is noisier than the
parts it is made of.

    .venv/bin/python bench/capture_offline.py -n 150
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import statistics
import time

from serving_latency import PROMPT, QWEN, TEMPERATURE  # bench/ is sys.path[0] when run as a script

# (owner module, attribute path) of the functions --in-place times: the log-probs path and its neighbours.
IN_PLACE = (
    ("vllm.v1.sample.sampler", "Sampler.forward"),
    ("vllm.v1.sample.sampler", "Sampler.gather_logprobs"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._bookkeeping_sync"),
    ("vllm.v1.engine.output_processor", "OutputProcessor.process_outputs"),
    ("vllm.v1.engine.logprobs", "LogprobsProcessor.update_from_output"),
    ("vllm.v1.engine.logprobs", "convert_ids_list_to_tokens"),
    ("vllm.v1.engine.logprobs", "append_logprobs_for_next_position"),
)


def time_in_place(spent: collections.Counter) -> None:
    """Wraps each IN_PLACE function so that its calls add their seconds to ``spent[name]``."""
    import importlib

    for module_name, path in IN_PLACE:
        owner = importlib.import_module(module_name)
        *outer, name = path.split(".")
        for part in outer:
            owner = getattr(owner, part)
        static = isinstance(vars(owner).get(name), staticmethod)
        raw = getattr(owner, name)

        def timed(*a, _raw=raw, _path=path, **kw):
            t0 = time.perf_counter()
            try:
                return _raw(*a, **kw)
            finally:
                spent[_path] += time.perf_counter() - t0

        functools.update_wrapper(timed, raw)
        setattr(owner, name, staticmethod(timed) if static else timed)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=150, help="requests per variant")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--token-strings", action="store_true", help="the sampled tokens' strings from a per-id table")
    ap.add_argument("--in-place", action="store_true", help="also time the log-probs path's functions where they run")
    args = ap.parse_args()

    from onlinerl.model import bootstrap_smollm2, default_cache_dir, make_tiny_model
    from onlinerl.vllm_flags import CPU_IN_PROCESS_EXECUTOR_ENV

    model = make_tiny_model(default_cache_dir() / "models" / "tiny-llama-2l", bootstrap_smollm2())
    os.environ.update({**CPU_IN_PROCESS_EXECUTOR_ENV, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_MAX_STOP_STRINGS": "16"})
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=str(model),
        dtype="float32",
        max_model_len=2048,
        logprobs_mode="processed_logprobs",
        distributed_executor_backend="uni",
        enable_lora=True,
        max_lora_rank=16,
    )
    in_place: dict[str, collections.Counter] = {name: collections.Counter() for name in ("none", "logprobs 0")}
    spent_now: collections.Counter = collections.Counter()
    if args.in_place:
        time_in_place(spent_now)  # before the table: it then wraps the timed function, whose calls are its misses
    if args.token_strings:
        from onlinerl_serving import vllm_token_strings

        assert vllm_token_strings.install() is not None
        filled = vllm_token_strings.prefill(llm.llm_engine.output_processor.tokenizer)
        print(f"token strings: {filled:,} ids decoded into the table at start")
    common = {"max_tokens": args.max_tokens, "temperature": TEMPERATURE, "ignore_eos": True, "stop": list(QWEN.stop)}
    variants = {"none": SamplingParams(**common), "logprobs 0": SamplingParams(logprobs=0, **common)}
    for params in variants.values():  # warm-up
        for _ in range(5):
            llm.generate([PROMPT], params, use_tqdm=False)
    spent: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}  # (wall, cpu) per request
    for _ in range(args.n):
        for name, params in variants.items():
            spent_now.clear()
            c0, t0 = time.process_time(), time.perf_counter()
            out = llm.generate([PROMPT], params, use_tqdm=False)
            spent[name].append((time.perf_counter() - t0, time.process_time() - c0))
            in_place[name].update(spent_now)
            assert len(out[0].outputs[0].token_ids) == args.max_tokens
    for name, xs in spent.items():
        wall, cpu = statistics.median(x[0] for x in xs), statistics.mean(x[1] for x in xs)
        print(f"{name:11s} wall p50 {wall * 1e3:6.2f} ms  CPU mean {cpu * 1e3:6.2f} ms")
    paired = [b[0] - a[0] for a, b in zip(spent["none"], spent["logprobs 0"], strict=True)]
    print(f"logprobs 0 - none, paired median wall: {statistics.median(paired) * 1e3:+.3f} ms (n = {args.n})")
    if args.in_place:
        print("timed in place, ms per request: none, logprobs 0, difference")
        for _, path in IN_PLACE:
            a, b = (in_place[name][path] / args.n * 1e3 for name in ("none", "logprobs 0"))
            print(f"  {path:42s} {a:7.3f} {b:7.3f} {b - a:+7.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
