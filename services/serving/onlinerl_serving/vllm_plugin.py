"""A vLLM general plugin (entry point ``vllm.general_plugins``): the sampled token's log-prob, lean, on CPU.

Why: the gateway asks vLLM for ``logprobs: 0`` on every request, the behaviour log-prob of each sampled token that
the trainer's PPO ratio needs (onlinerl_serving.requests.upstream_body). vLLM then also counts the token's rank
(``Sampler.gather_logprobs``: how many vocabulary entries score at least as high) with
``batched_count_greater_than``, a ``torch.compile``d one-liner. On GPU the compiled kernel saves a [batch, vocab]
temporary. On CPU, for one token at a time, each call pays TorchDynamo's guard checks and dispatch: measured with
py-spy on the tiny model, that dispatch was most of ``gather_logprobs``, and logprobs=0 cost the engine 3.5-4.1 ms
of CPU per 16-token request (bench/RESULTS.md, issue 40). The same count in eager torch is one comparison and one
sum over the row: the same integers, none of the dispatch. With ``logprobs: 0`` the rest of ``gather_logprobs``
(a top-0 ``topk``, two concatenations with its empty result, the dynamo size markings) only adds calls.

So on a CPU platform, and only for the vLLM release whose code this was read against:
- the sampler module's name ``batched_count_greater_than`` is rebound to the eager count (every caller);
- ``Sampler.gather_logprobs`` with ``num_logprobs == 0`` returns the sampled token and its log-prob directly; any
  other count goes to vLLM's own;
- with ``num_logprobs == 0`` the rank is not counted at all: its tensor holds 0 ("not counted"). No response of
  the OpenAI server carries a rank (completions and chat return tokens and log-probs; the one reader, the scale-out
  token-in-token-out route, maps a 0 rank to "none"), and counting it is a comparison and a sum over the whole
  vocabulary for every generated token: 24 µs per token on this CPU, beside 19 µs for the log-softmax the log-prob
  itself needs (measured on a [1, 49152] row, one thread). ``ONLINERL_VLLM_COUNT_RANK=1`` counts it again.
Nothing else changes: the same token ids and log-probs, values and dtypes (tests/serving/test_vllm_plugin.py
compares them with vLLM's own functions). GPU engines run upstream vLLM images without this package; there, and on
any other vLLM release, :func:`register` changes nothing and logs why.

vLLM 0.32 loads general plugins in the engine core and its workers (not in the API server) and may load them more
than once: :func:`register` is idempotent. The API server's share of the log-probs' cost is handled by the in-process
gateway, which runs there (onlinerl_serving.vllm_token_strings).
"""

from __future__ import annotations

import logging
import os

import torch

# Under "vllm.": vLLM gives its own loggers a handler, so the lines land in the engine log with its format.
log = logging.getLogger("vllm.plugins.onlinerl")

# The vLLM releases whose Sampler.gather_logprobs was read for this (it calls the module-level name below).
READ_AGAINST = ("0.32.",)
PATCHED_NAME = "batched_count_greater_than"


def count_at_least_eager(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Per row of ``x`` [batch, vocab], how many entries are >= that row's value in ``values`` [batch, 1]: vLLM's
    ``batched_count_greater_than`` (despite its name it counts ``>=``, so the sampled token counts itself: rank 1 is
    the top token), without torch.compile."""
    return (x >= values).sum(-1)


# ``ONLINERL_VLLM_COUNT_RANK=1`` counts the sampled token's rank again (vLLM's value), e.g. to measure what skipping
# it saves (bench/serving_latency.py --ab-rank).
COUNT_RANK_ENV = "ONLINERL_VLLM_COUNT_RANK"


def count_rank() -> bool:
    return os.environ.get(COUNT_RANK_ENV, "") == "1"


def sampled_only(original):
    """``Sampler.gather_logprobs`` that answers ``num_logprobs == 0`` itself (the sampled token alone: what the
    gateway asks for) and hands every other count to ``original``. ``ONLINERL_VLLM_COUNT_RANK`` is read here, once,
    not per generated token."""
    from vllm.v1.outputs import LogprobsTensors

    counted = count_rank()

    def gather_logprobs(logprobs: torch.Tensor, num_logprobs: int, token_ids: torch.Tensor) -> LogprobsTensors:
        if num_logprobs != 0:
            return original(logprobs, num_logprobs, token_ids)
        token_ids = token_ids.unsqueeze(-1)  # [n, 1]
        token_logprobs = logprobs.gather(-1, token_ids)  # [n, 1]
        if counted:
            ranks = count_at_least_eager(logprobs, token_logprobs)  # [n]
        else:
            ranks = torch.zeros(token_ids.shape[0], dtype=torch.int64)  # [n]: 0 = not counted (module docstring)
        return LogprobsTensors(token_ids.to(torch.int32), token_logprobs, ranks)

    gather_logprobs.onlinerl_original = original  # type: ignore[attr-defined]
    return gather_logprobs


def register() -> None:
    """Entry point: on CPU with a vLLM release in READ_AGAINST, the eager rank count and the lean sampled-only
    gather (module docstring)."""
    import vllm
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    if not vllm.__version__.startswith(READ_AGAINST):
        log.info(
            "onlinerl vLLM plugin: vLLM %s is not one it was read against %s: not applied",
            vllm.__version__,
            READ_AGAINST,
        )
        return
    from vllm.v1.sample import sampler

    current = getattr(sampler, PATCHED_NAME, None)
    if current is count_at_least_eager:
        return
    if current is None:
        log.warning("onlinerl vLLM plugin: vllm.v1.sample.sampler has no %s: not applied", PATCHED_NAME)
        return
    setattr(sampler, PATCHED_NAME, count_at_least_eager)
    original = sampler.Sampler.gather_logprobs
    if getattr(original, "onlinerl_original", None) is None:
        sampler.Sampler.gather_logprobs = staticmethod(sampled_only(original))
    log.info(
        "onlinerl vLLM plugin: the sampled token's rank is counted eagerly on CPU, and logprobs=0 gathers only the "
        "sampled token (issue 40)"
    )
