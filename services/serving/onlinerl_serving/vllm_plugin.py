"""A vLLM general plugin (entry point ``vllm.general_plugins``): the sampled token's rank counted eagerly on CPU.

Why: the gateway asks vLLM for ``logprobs: 0`` on every request, the behaviour log-prob of each sampled token that
the trainer's PPO ratio needs (onlinerl_serving.requests.upstream_body). vLLM then also counts the token's rank
(``Sampler.gather_logprobs``: how many vocabulary entries score at least as high) with
``batched_count_greater_than``, a ``torch.compile``d one-liner. On GPU the compiled kernel saves a [batch, vocab]
temporary. On CPU, for one token at a time, each call pays TorchDynamo's guard checks and dispatch: measured with
py-spy on the tiny model, that dispatch was most of ``gather_logprobs``, and logprobs=0 cost the engine 3.5-4.1 ms
of CPU per 16-token request (bench/RESULTS.md, issue 40). The same count in eager torch is one comparison and one
sum over the row: the same integers, none of the dispatch.

So on a CPU platform, and only for the vLLM release whose code this was read against, the sampler module's name
``batched_count_greater_than`` is rebound to the eager count. Nothing else changes: the same log-probs, the same
ranks (tests/serving/test_vllm_plugin.py compares both against the compiled function). GPU engines run upstream
vLLM images without this package; there, and on any other vLLM release, :func:`register` changes nothing and logs why.

vLLM loads general plugins in every process it starts (API server, engine core, workers) and may load them more
than once: :func:`register` is idempotent.
"""

from __future__ import annotations

import logging

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


def register() -> None:
    """Entry point: on CPU with a vLLM release in READ_AGAINST, rebind the sampler's rank count to the eager one."""
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
    log.info("onlinerl vLLM plugin: the sampled token's rank is counted eagerly on CPU (issue 40)")
