"""The sampled tokens' strings, decoded once per id (onlinerl_serving.vllm_token_strings; issue 40).

The promise is "the same strings vLLM gives": checked for every id of the tiny model's vocabulary through vLLM's own
tokenizer pool, and through vLLM's own log-probs processor on text whose characters are split across tokens (the
one case where vLLM repairs a token's string from its neighbours). The cache's own rules (ask only for unseen ids,
a tokenizer that cannot be keyed, a full table) are checked against a counting stand-in for vLLM's function.
"""

from __future__ import annotations

import copy
import gc

import numpy as np
import pytest

from onlinerl_serving import vllm_token_strings
from onlinerl_serving.vllm_token_strings import cached_token_strings


@pytest.fixture(scope="module")
def pooled_tokenizer(tiny_model_path):
    """The tiny model's tokenizer as vLLM's API server holds it: cached, behind its thread-safe pool."""
    from vllm.tokenizers.hf import maybe_make_thread_pool
    from vllm.tokenizers.registry import get_tokenizer

    return maybe_make_thread_pool(copy.copy(get_tokenizer(str(tiny_model_path))))


def vllms_convert():
    from vllm.tokenizers.detokenizer_utils import convert_ids_list_to_tokens

    return convert_ids_list_to_tokens


def test_every_id_of_the_vocabulary_gets_vllms_string(pooled_tokenizer):
    original = vllms_convert()
    cached = cached_token_strings(original)
    ids = list(range(len(pooled_tokenizer)))
    expected = original(pooled_tokenizer, ids)
    assert [cached(pooled_tokenizer, [i])[0] for i in ids] == expected  # each decoded on first sight
    assert cached(pooled_tokenizer, ids) == expected  # then all from the table
    assert any(s.endswith("\ufffd") for s in expected)  # byte tokens are in the check, not only whole words


class Counting:
    """A stand-in for vLLM's function that records which ids it was asked for."""

    def __init__(self):
        self.asked: list[list[int]] = []

    def __call__(self, tokenizer, token_ids):
        self.asked.append(list(token_ids))
        return [f"<{tokenizer.name}:{t}>" for t in token_ids]


class Tok:
    def __init__(self, name: str):
        self.name = name


def test_only_ids_not_seen_with_that_tokenizer_are_decoded():
    original = Counting()
    cached = cached_token_strings(original)
    a, b = Tok("a"), Tok("b")
    assert cached(a, [5, 6, 5]) == ["<a:5>", "<a:6>", "<a:5>"]
    assert cached(a, [6, 7, 5]) == ["<a:6>", "<a:7>", "<a:5>"]
    assert cached(b, [5]) == ["<b:5>"]  # another tokenizer has its own table
    assert cached(a, []) == []
    assert original.asked == [[5, 6, 5], [7], [5]]


def test_a_dropped_tokenizer_takes_its_table_with_it():
    cached = cached_token_strings(Counting())
    tok = Tok("gone")
    cached(tok, [1, 2])
    assert len(cached.tables) == 1
    del tok
    gc.collect()
    assert len(cached.tables) == 0


def test_a_tokenizer_that_cannot_be_keyed_gets_vllms_function_every_time():
    class Unhashable(Tok):
        __hash__ = None  # type: ignore[assignment]

    original = Counting()
    cached = cached_token_strings(original)
    tok = Unhashable("u")
    assert cached(tok, [3]) == cached(tok, [3]) == ["<u:3>"]
    assert original.asked == [[3], [3]]


def test_a_full_table_still_returns_every_string(monkeypatch):
    monkeypatch.setattr(vllm_token_strings, "MAX_CACHED_IDS", 2)
    original = Counting()
    cached = cached_token_strings(original)
    tok = Tok("f")
    assert cached(tok, [1, 2]) == ["<f:1>", "<f:2>"]
    assert cached(tok, [3, 1]) == ["<f:3>", "<f:1>"]  # 3 does not fit: decoded, returned, not kept
    assert cached(tok, [3]) == ["<f:3>"]
    assert original.asked == [[1, 2], [3], [3]]


def sampled_strings(tokenizer, token_ids: list[int]) -> list[str]:
    """What vLLM's API server makes of a generation's log-probs, one engine step per token: the decoded string
    of each sampled token, after vLLM's repair of characters split across tokens."""
    from vllm.v1.engine.logprobs import LogprobsProcessor
    from vllm.v1.outputs import LogprobsLists

    proc = LogprobsProcessor(
        tokenizer=tokenizer,
        logprobs=[],
        prompt_logprobs=None,
        cumulative_logprob=0.0,
        num_logprobs=0,
        num_prompt_logprobs=None,
    )
    for t in token_ids:
        proc._update_sample_logprobs(
            LogprobsLists(np.array([[t]]), np.array([[-0.5]], dtype=np.float32), np.array([0]), None)
        )
    return [position[t].decoded_token for position, t in zip(proc.logprobs, token_ids, strict=True)]


def test_vllms_logprobs_processor_makes_the_same_strings_through_the_cache(pooled_tokenizer, monkeypatch):
    from vllm.v1.engine import logprobs

    text = "naïve café → 😀 def f(x):\n    return x  # 中文"
    ids = pooled_tokenizer.encode(text, add_special_tokens=False)
    original = getattr(logprobs.convert_ids_list_to_tokens, "onlinerl_original", logprobs.convert_ids_list_to_tokens)
    monkeypatch.setattr(logprobs, "convert_ids_list_to_tokens", original)
    expected = sampled_strings(pooled_tokenizer, ids)
    assert "".join(expected) == text  # vLLM's repair put the split characters together again
    assert any(original(pooled_tokenizer, [t])[0].endswith("\ufffd") for t in ids)  # so there was something to repair

    monkeypatch.setattr(logprobs, "convert_ids_list_to_tokens", cached_token_strings(original))
    assert sampled_strings(pooled_tokenizer, ids) == expected
    assert sampled_strings(pooled_tokenizer, ids) == expected  # the second time every id comes from the table


def test_install_rebinds_vllms_name_once(monkeypatch):
    from vllm.v1.engine import logprobs

    original = getattr(logprobs.convert_ids_list_to_tokens, "onlinerl_original", logprobs.convert_ids_list_to_tokens)
    monkeypatch.setattr(logprobs, "convert_ids_list_to_tokens", original)
    assert vllm_token_strings.install() is True
    assert vllm_token_strings.install() is False  # vLLM may load a plugin more than once per process
    assert logprobs.convert_ids_list_to_tokens.onlinerl_original is original
    monkeypatch.delattr(logprobs, "convert_ids_list_to_tokens")
    assert vllm_token_strings.install() is None


def test_install_changes_nothing_outside_vllms_process_or_on_another_release(monkeypatch):
    import sys

    import vllm
    from vllm.v1.engine import logprobs

    original = getattr(logprobs.convert_ids_list_to_tokens, "onlinerl_original", logprobs.convert_ids_list_to_tokens)
    monkeypatch.setattr(logprobs, "convert_ids_list_to_tokens", original)
    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    assert vllm_token_strings.install() is None
    monkeypatch.delitem(sys.modules, "vllm")  # a test's stand-in app: vLLM was never imported
    assert vllm_token_strings.install() is None
    assert logprobs.convert_ids_list_to_tokens is original


def test_a_prefilled_table_decodes_no_generated_token(pooled_tokenizer, monkeypatch):
    from vllm.v1.engine import logprobs

    original = getattr(logprobs.convert_ids_list_to_tokens, "onlinerl_original", logprobs.convert_ids_list_to_tokens)
    asked: list[int] = []

    def counting(tokenizer, token_ids):
        asked.extend(token_ids)
        return original(tokenizer, token_ids)

    monkeypatch.setattr(logprobs, "convert_ids_list_to_tokens", cached_token_strings(counting))
    assert vllm_token_strings.prefill(pooled_tokenizer) == len(pooled_tokenizer) == 49152
    assert vllm_token_strings.prefill(pooled_tokenizer) == 0  # every id is held already
    asked.clear()
    text = "naïve café → 😀 def f(x):\n    return x  # 中文"
    ids = pooled_tokenizer.encode(text, add_special_tokens=False)
    assert "".join(sampled_strings(pooled_tokenizer, ids)) == text
    assert asked == []  # every generated token's string came from the table


def test_prefill_changes_nothing_without_the_table_or_a_keyable_tokenizer(monkeypatch):
    from vllm.v1.engine import logprobs

    original = getattr(logprobs.convert_ids_list_to_tokens, "onlinerl_original", logprobs.convert_ids_list_to_tokens)
    monkeypatch.setattr(logprobs, "convert_ids_list_to_tokens", original)
    assert vllm_token_strings.prefill(Tok("x")) == 0  # vLLM's own function: nothing to fill

    class Sized(Tok):
        __hash__ = None  # type: ignore[assignment]

        def __len__(self) -> int:
            return 3

    original_counting = Counting()
    monkeypatch.setattr(logprobs, "convert_ids_list_to_tokens", cached_token_strings(original_counting))
    assert vllm_token_strings.prefill(Sized("s")) == 0
    assert vllm_token_strings.prefill(Tok("no length")) == 0
    assert original_counting.asked == []


def test_the_serving_tokenizer_is_the_one_vllms_output_processor_holds():
    from types import SimpleNamespace

    tok = Tok("served")
    processor = SimpleNamespace(tokenizer=tok)
    app = SimpleNamespace(state=SimpleNamespace(engine_client=SimpleNamespace(output_processor=processor)))
    assert vllm_token_strings.serving_tokenizer(app) is tok
    assert vllm_token_strings.serving_tokenizer(SimpleNamespace(state=SimpleNamespace())) is None
    assert vllm_token_strings.serving_tokenizer(None) is None


def vllm_app(tokenizer):
    """What install_and_fill reads of vLLM's FastAPI app: the output processor's tokenizer."""
    from types import SimpleNamespace

    client = SimpleNamespace(output_processor=SimpleNamespace(tokenizer=tokenizer))
    return SimpleNamespace(state=SimpleNamespace(engine_client=client))


def test_the_gateway_start_installs_fills_and_logs_once(pooled_tokenizer, monkeypatch, caplog):
    from vllm.v1.engine import logprobs

    original = getattr(logprobs.convert_ids_list_to_tokens, "onlinerl_original", logprobs.convert_ids_list_to_tokens)
    monkeypatch.setattr(logprobs, "convert_ids_list_to_tokens", original)
    caplog.set_level("INFO", logger="onlinerl.gateway.inprocess")
    assert vllm_token_strings.install_and_fill(vllm_app(pooled_tokenizer)) == 49152
    assert "from a table per token id: 49152 decoded at start" in caplog.text
    assert vllm_token_strings.install_and_fill(vllm_app(pooled_tokenizer)) is None  # installed already


def test_a_tokenizer_that_fails_at_start_leaves_the_table_to_fill_as_ids_come(monkeypatch, caplog):
    from vllm.v1.engine import logprobs

    class Failing(Tok):
        def __len__(self) -> int:
            return 10

    def vllms(tokenizer, token_ids):
        if len(token_ids) > 1:
            raise RuntimeError("id 7 has no string")
        return [f"<{t}>" for t in token_ids]

    monkeypatch.setattr(logprobs, "convert_ids_list_to_tokens", vllms)
    tok = Failing("f")
    assert vllm_token_strings.install_and_fill(vllm_app(tok)) == 0  # serving starts
    assert "could not be decoded at start" in caplog.text and "id 7 has no string" in caplog.text
    assert logprobs.convert_ids_list_to_tokens(tok, [3]) == ["<3>"]  # installed: the table fills as ids come
    assert dict(logprobs.convert_ids_list_to_tokens.tables[tok]) == {3: "<3>"}
