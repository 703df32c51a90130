"""The strings of sampled tokens in vLLM's log-probs, decoded once per token id and tokenizer, not once per token.

Why: with ``logprobs: 0`` (what the gateway asks on every request, for the behaviour log-prob) vLLM's API server
turns each sampled token into its string as it arrives: ``LogprobsProcessor._update_sample_logprobs`` calls
``convert_ids_list_to_tokens``, which runs ``decode([id])`` (and, for SentencePiece vocabularies,
``convert_ids_to_tokens``) through vLLM's thread-safe tokenizer pool: a queue borrow and a context manager per call,
6-9 µs per generated token timed alone and about 50 µs inside a running engine, against 0.6-1.2 µs from a table
(``bench/token_strings.py``, ``bench/capture_offline.py --in-place``; bench/RESULTS.md, issue 40): paid on every
token of every request, in the process that also runs the gateway. The string vLLM computes there is a function of
the token id and the tokenizer alone: it "detokenizes the input ids individually". The one repair that needs the
neighbouring tokens, a UTF-8 fragment decoded with its context (``LogprobsProcessor._verify_tokens``), runs after it
on what it returns, unchanged. So a table per tokenizer of the ids seen so far returns the same strings, and a served
vocabulary is decoded at most once per process.

A table can also be filled at start with the whole vocabulary (:func:`prefill`; the in-process gateway does, with
the tokenizer vLLM's output processor holds): 0.3-0.6 s for the tiny model's 49,152 ids here, about three times that
for Qwen2.5's 151,665, and a few MB. Then no generated token is decoded while a user waits, not even the first use
of a rare id. Inside a running engine that decode measured 50 µs a token, not the 3-9 µs it takes warm: the forward
pass between two tokens leaves the tokenizer's caches cold (``bench/capture_offline.py --in-place``). And a random
test model samples a new id for nearly every token, so a table filled only as ids come would rarely hit there.

The tables are keyed weakly by the tokenizer object, so a tokenizer vLLM drops takes its table with it. A tokenizer
that cannot be keyed (unhashable or not weakly referable) gets vLLM's function, uncached.
"""

from __future__ import annotations

import logging
import sys
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger("onlinerl.gateway.inprocess")  # logged at the in-process gateway's start, with its lines

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


def serving_tokenizer(app: Any) -> Any:
    """The tokenizer vLLM's output processor hands each request's log-probs processor (vLLM 0.32:
    ``app.state.engine_client.output_processor.tokenizer``), or None where that path does not exist."""
    client = getattr(getattr(app, "state", None), "engine_client", None)
    return getattr(getattr(client, "output_processor", None), "tokenizer", None)


def prefill(tokenizer: Any) -> int:
    """Decodes every id of ``tokenizer``'s vocabulary (up to MAX_CACHED_IDS) into the installed table now, with
    vLLM's own function: the number of ids decoded, 0 when the table is not installed, the tokenizer cannot be keyed
    or has no length, or every id is held already."""
    from vllm.v1.engine import logprobs

    convert = getattr(logprobs, "convert_ids_list_to_tokens", None)
    tables = getattr(convert, "tables", None)
    if convert is None or tables is None:
        return 0
    try:
        size = min(len(tokenizer), MAX_CACHED_IDS)
        held = len(tables.get(tokenizer, ()))
    except TypeError:
        return 0
    convert(tokenizer, range(size))
    return len(tables.get(tokenizer, ())) - held


def install_and_fill(app: Any) -> int | None:
    """At the in-process gateway's start, in vLLM's API server: installs the table and fills it with the vocabulary
    of the tokenizer vLLM's output processor holds (``app`` is vLLM's FastAPI app), and logs it. The number of ids
    decoded, or None when nothing was installed (outside vLLM, another release, or installed already). A tokenizer
    that fails on some id is logged and leaves the table to fill as ids come: serving starts either way."""
    if not install():
        return None
    started = time.perf_counter()
    tokenizer = serving_tokenizer(app)
    try:
        decoded = prefill(tokenizer) if tokenizer is not None else 0
    except Exception:
        log.warning("the sampled tokens' strings could not be decoded at start: each is as it comes", exc_info=True)
        return 0
    log.info(
        "vLLM's log-probs get each sampled token's string from a table per token id: %d decoded at start in %.2f s",
        decoded,
        time.perf_counter() - started,
    )
    return decoded
