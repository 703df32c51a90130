"""The vLLM plugin (issue 40): on CPU the sampled token's rank is counted eagerly, to the same integers, and for
logprobs=0 (what the gateway asks) not at all.

Unit: the eager count equals vLLM's compiled one, ties included; registering rebinds the sampler's name once.
Through the real engine: the shared engine loaded the plugin (its log says so) and still returns one behaviour
log-prob per token. That those log-probs are the policy's is proven where it matters, against the trainer's forward
(tests/trainer/test_exactly_served.py).
"""

from __future__ import annotations

import httpx
import torch

from onlinerl_serving import vllm_plugin


def test_the_eager_count_is_vllms_count_ties_included():
    from vllm.v1.sample.ops.logprobs import batched_count_greater_than

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 49152, generator=gen).log_softmax(-1)
    x[1, :100] = x[1, 5]  # a tie: 100 entries equal to the sampled one's value
    values = x.gather(-1, torch.tensor([[7], [5], [49151]]))
    eager = vllm_plugin.count_at_least_eager(x, values)
    assert torch.equal(eager, batched_count_greater_than(x, values))
    assert eager[1].item() >= 100  # the tie counts, as vLLM's ">=" does: rank 1 is the top token


def test_the_sampled_only_gather_returns_vllms_tensors_and_leaves_top_k_to_vllm():
    from vllm.v1.sample.sampler import Sampler

    original = getattr(Sampler.gather_logprobs, "onlinerl_original", Sampler.gather_logprobs)
    lean = vllm_plugin.sampled_only(original)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 49152, generator=gen).log_softmax(-1)
    sampled = torch.tensor([3, 49151, 0, 77])
    for k in (0, 2):
        ours, theirs = lean(x, k, token_ids=sampled), original(x, k, token_ids=sampled)
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            if k == 0 and i == 2:  # the rank, not counted for logprobs=0: zeros of vLLM's dtype
                assert a.dtype == b.dtype and a.shape == b.shape and not a.any() and b.min() >= 1
                continue
            assert (a is None and b is None) or (a.dtype == b.dtype and torch.equal(a, b))


def test_the_rank_is_counted_again_on_request(monkeypatch):
    from vllm.v1.sample.sampler import Sampler

    monkeypatch.setenv(vllm_plugin.COUNT_RANK_ENV, "1")
    original = getattr(Sampler.gather_logprobs, "onlinerl_original", Sampler.gather_logprobs)
    x = torch.randn(2, 49152, generator=torch.Generator().manual_seed(2)).log_softmax(-1)
    sampled = torch.tensor([9, 4])
    ours, theirs = vllm_plugin.sampled_only(original)(x, 0, token_ids=sampled), original(x, 0, token_ids=sampled)
    for a, b in zip(ours, theirs, strict=True):
        assert (a is None and b is None) or (a.dtype == b.dtype and torch.equal(a, b))


def test_register_rebinds_the_samplers_count_and_gather_once_on_cpu():
    from vllm.v1.sample import sampler

    vllm_plugin.register()
    vllm_plugin.register()  # vLLM may load a plugin more than once per process
    assert sampler.batched_count_greater_than is vllm_plugin.count_at_least_eager
    gather = sampler.Sampler.gather_logprobs
    assert gather.onlinerl_original is not None
    assert getattr(gather.onlinerl_original, "onlinerl_original", None) is None  # wrapped once, not twice


def test_the_shared_engine_loaded_the_plugin(tiny_lora_engine):
    log = tiny_lora_engine.child.log_path.read_text(errors="replace")
    assert "the sampled token's rank is counted eagerly on CPU" in log
    r = httpx.post(
        f"{tiny_lora_engine.url}/v1/completions",
        json={
            "model": "onlinerl-base",
            "prompt": "def add(a, b):\n",
            "max_tokens": 8,
            "logprobs": 0,
            "temperature": 0.7,
            "ignore_eos": True,
        },
        timeout=60,
    )
    r.raise_for_status()
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == 8 and all(v <= 0.0 for v in lp["token_logprobs"])
