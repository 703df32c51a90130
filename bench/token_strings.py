"""What vLLM's API server spends to give each sampled token of ``logprobs: 0`` its string, with and without the
per-id table of onlinerl_serving.vllm_token_strings (issue 40).

Times ``convert_ids_list_to_tokens`` for one token, as vLLM's log-probs processor calls it once per generated token,
on the tiny model's tokenizer held as vLLM's API server holds it (cached, behind its thread-safe pool), and checks
that both give the same string for every id timed.

    .venv/bin/python bench/token_strings.py
"""

from __future__ import annotations

import argparse
import copy
import random
import timeit


def per_call(convert, tokenizer, ids: list[int], n: int) -> float:
    """Mean seconds of ``convert(tokenizer, [id])`` over ``n`` calls, cycling through ``ids``."""
    cycle = iter(ids * (n // len(ids) + 1))
    return timeit.timeit(lambda: convert(tokenizer, [next(cycle)]), number=n) / n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=20_000, help="calls per variant")
    args = ap.parse_args()

    from vllm.tokenizers.detokenizer_utils import convert_ids_list_to_tokens
    from vllm.tokenizers.hf import maybe_make_thread_pool
    from vllm.tokenizers.registry import get_tokenizer

    from onlinerl.model import bootstrap_smollm2, default_cache_dir, make_tiny_model
    from onlinerl_serving.vllm_token_strings import cached_token_strings

    model = make_tiny_model(default_cache_dir() / "models" / "tiny-llama-2l", bootstrap_smollm2())
    tokenizers = {"cached": get_tokenizer(str(model))}
    tokenizers["pooled (vLLM's API server)"] = maybe_make_thread_pool(copy.copy(tokenizers["cached"]))
    table = cached_token_strings(convert_ids_list_to_tokens)
    ids = random.Random(0).sample(range(len(tokenizers["cached"])), 1000)
    print(f"per generated token, mean of {args.n:,} calls (µs):")
    for name, tok in tokenizers.items():
        assert [table(tok, [i]) for i in ids] == [convert_ids_list_to_tokens(tok, [i]) for i in ids]
        vllms, ours = (per_call(convert, tok, ids, args.n) for convert in (convert_ids_list_to_tokens, table))
        print(f"  {name:28s} vLLM's {vllms * 1e6:6.2f}  from the table {ours * 1e6:5.2f}  ({vllms / ours:.1f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
