"""What ``logprobs: 0`` costs vLLM without HTTP, without the gateway and without a second process (issue 40).

``vllm.LLM`` on the tiny model in this one process (engine core in-process), with the server's flags that shape the
sampler (``--logprobs-mode processed_logprobs``, LoRA on, the uni executor, float32), generates the same 16 tokens at
the serving temperature with and without ``logprobs=0``, interleaved, and prints the paired median difference in wall
time and the CPU time of each. What remains in that difference is vLLM's own per-token log-probs path: the
sampler's gather, the tensors turned into lists, the output processor's ``Logprob`` objects and strings.
``--token-strings`` installs onlinerl_serving.vllm_token_strings first, as the in-process gateway does.

    .venv/bin/python bench/capture_offline.py -n 150
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from serving_latency import PROMPT, QWEN, TEMPERATURE  # bench/ is sys.path[0] when run as a script


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=150, help="requests per variant")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--token-strings", action="store_true", help="the sampled tokens' strings from a per-id table")
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
    if args.token_strings:
        from onlinerl_serving import vllm_token_strings

        assert vllm_token_strings.install() is not None
    common = {"max_tokens": args.max_tokens, "temperature": TEMPERATURE, "ignore_eos": True, "stop": list(QWEN.stop)}
    variants = {"none": SamplingParams(**common), "logprobs 0": SamplingParams(logprobs=0, **common)}
    for params in variants.values():  # warm-up
        for _ in range(5):
            llm.generate([PROMPT], params, use_tqdm=False)
    spent: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}  # (wall, cpu) per request
    for _ in range(args.n):
        for name, params in variants.items():
            c0, t0 = time.process_time(), time.perf_counter()
            out = llm.generate([PROMPT], params, use_tqdm=False)
            spent[name].append((time.perf_counter() - t0, time.process_time() - c0))
            assert len(out[0].outputs[0].token_ids) == args.max_tokens
    for name, xs in spent.items():
        wall, cpu = statistics.median(x[0] for x in xs), statistics.mean(x[1] for x in xs)
        print(f"{name:11s} wall p50 {wall * 1e3:6.2f} ms  CPU mean {cpu * 1e3:6.2f} ms")
    paired = [b[0] - a[0] for a, b in zip(spent["none"], spent["logprobs 0"], strict=True)]
    print(f"logprobs 0 - none, paired median wall: {statistics.median(paired) * 1e3:+.3f} ms (n = {args.n})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
