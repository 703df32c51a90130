"""The strings of sampled tokens in vLLM's log-probs, decoded once per token id and tokenizer, not once per token.

Why: with ``logprobs: 0`` (what the gateway asks on every request, for the behaviour log-prob) vLLM's API server
turns each sampled token into its string as it arrives: ``LogprobsProcessor._update_sample_logprobs`` calls
``convert_ids_list_to_tokens``, which runs ``decode([id])`` (and, for SentencePiece vocabularies,
``convert_ids_to_tokens``) through vLLM's thread-safe tokenizer pool: a queue borrow and a context manager per call,
6-12 µs per generated token against 0.6-1 µs from a table (``bench/token_strings.py``; bench/RESULTS.md, issue 40).
Small per token, but paid on every token of every request, in the process that also runs the gateway. The string
vLLM computes there is a function of the token id and the tokenizer alone: it "detokenizes the input ids
individually". The one repair that needs the neighbouring tokens, a UTF-8 fragment decoded with its
context (``LogprobsProcessor._verify_tokens``), runs after it on what it returns, unchanged. So a table per tokenizer
of the ids seen so far returns the same strings, and a served vocabulary is decoded at most once per process.

The tables are keyed weakly by the tokenizer object, so a tokenizer vLLM drops takes its table with it. A tokenizer
that cannot be keyed (unhashable or not weakly referable) gets vLLM's function, uncached.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Sequence
from typing import Any

# Ids kept per tokenizer: above any vocabulary we serve (SmolLM2 49,152; Qwen2.5 151,665), so in practice a table
# never fills; if one did, the ids past it are decoded each time, as vLLM does.
MAX_CACHED_IDS = 1 << 18

Convert = Callable[[Any, Sequence[int]], list[str]]


def cached_token_strings(original: Convert) -> Convert:
    """``convert_ids_list_to_tokens`` (vLLM's signature) that asks ``original`` only for ids it has not seen with
    this tokenizer, and returns the same list ``original`` would."""
    tables: weakref.WeakKeyDictionary[Any, dict[int, str]] = weakref.WeakKeyDictionary()

    def convert_ids_list_to_tokens(tokenizer: Any, token_ids: Sequence[int]) -> list[str]:
        try:
            table = tables.get(tokenizer)
            if table is None:
                table = tables[tokenizer] = {}
        except TypeError:
            return original(tokenizer, token_ids)
        missing = [t for t in token_ids if t not in table]
        if not missing:
            return [table[t] for t in token_ids]
        fresh = dict(zip(missing, original(tokenizer, missing), strict=True))
        if len(table) + len(fresh) <= MAX_CACHED_IDS:
            table.update(fresh)
        return [fresh[t] if t in fresh else table[t] for t in token_ids]

    convert_ids_list_to_tokens.onlinerl_original = original  # type: ignore[attr-defined]
    convert_ids_list_to_tokens.tables = tables  # type: ignore[attr-defined]  # what is held, for tests
    return convert_ids_list_to_tokens


def install() -> bool | None:
    """In vLLM's API server (the in-process gateway calls this at its start; vLLM 0.32 loads no general plugin
    there): rebinds the name vLLM's log-probs processor calls to the cached one, once per process. True when it did
    now, False when it already had, None when it changed nothing: not in a process that runs vLLM (a test's
    stand-in app: vLLM is not imported for this), a vLLM release this was not read against
    (``vllm_plugin.READ_AGAINST``), or no such name."""
    vllm = sys.modules.get("vllm")
    if vllm is None:
        return None
    from onlinerl_serving.vllm_plugin import READ_AGAINST  # here: the plugin module imports torch

    if not getattr(vllm, "__version__", "").startswith(READ_AGAINST):
        return None
    from vllm.v1.engine import logprobs

    current = getattr(logprobs, "convert_ids_list_to_tokens", None)
    if current is None:
        return None
    if getattr(current, "onlinerl_original", None) is not None:
        return False
    logprobs.convert_ids_list_to_tokens = cached_token_strings(current)
    return True
