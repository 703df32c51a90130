"""Pure parts of serving: request validation, routing, response stripping, capture, manifests, vLLM argv."""

from __future__ import annotations

import hashlib
from pathlib import Path

import orjson
import pytest

from onlinerl.config import from_mapping
from onlinerl.schemas import CheckpointManifest, PolicyTable, SamplingParams
from onlinerl_serving.capture import RolloutAccumulator, client_view
from onlinerl_serving.checkpoints import Announcement, CheckpointError, verify_checkpoint
from onlinerl_serving.engine import vllm_argv, vllm_env
from onlinerl_serving.errors import ApiError
from onlinerl_serving.requests import (
    Limits,
    parse_completion_request,
    sampling_record,
    upstream_body,
    with_exploration,
)
from onlinerl_serving.routing import (
    choose,
    newest_loaded_at_most,
    route,
    served_model_name,
    user_hash,
    user_point,
    version_of_model,
)

LIMITS = Limits(max_prompt_chars=100, max_tokens_cap=4096, max_model_len=2048)


# --- request validation -------------------------------------------------------------------------------------------
def test_continue_request_is_accepted_and_forwarded_with_capture_fields() -> None:
    stop = [
        "<|endoftext|>",
        "<|fim_prefix|>",
        "<|fim_middle|>",
        "<|fim_suffix|>",
        "<|fim_pad|>",
        "<|repo_name|>",
        "<|file_sep|>",
        "<|im_start|>",
        "<|im_end|>",
        "/src/",
        "#- coding: utf-8",
        "```",
    ]
    raw = orjson.dumps(
        {
            "model": "qwen",
            "prompt": "<|fim_prefix|>a<|fim_suffix|>b<|fim_middle|>",
            "max_tokens": 4096,
            "temperature": 0.01,
            "stop": stop,
            "stream": True,
            "unknown_extra": 1,
        }
    )
    req = parse_completion_request(raw, LIMITS)
    assert req.max_tokens == 2048  # clamped to the context: vLLM would refuse 4096 > max_model_len
    up = orjson.loads(upstream_body(req, "job-v3", stream_interval=8))
    assert up == {
        "model": "job-v3",
        "prompt": req.prompt,
        "max_tokens": 2048,
        "stream": True,
        "stop": stop,
        "logprobs": 0,
        "return_token_ids": True,
        "temperature": 0.01,
        # every control the trainer cannot model is pinned neutral: no generation_config default applies upstream
        "top_p": 1.0,
        "top_k": 0,
        "min_p": 0.0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "repetition_penalty": 1.0,
        "stream_interval": 8,
    }
    non_stream = parse_completion_request(raw.replace(b'"stream":true', b'"stream":false'), LIMITS)
    assert "stream_interval" not in orjson.loads(upstream_body(non_stream, "job-v3", stream_interval=8))


def test_client_logprobs_and_usage_are_forwarded() -> None:
    req = parse_completion_request(
        b'{"prompt": "x", "logprobs": 2, "stream": true, "stream_options": {"include_usage": true}}', LIMITS
    )
    up = orjson.loads(upstream_body(req, "m"))
    assert up["logprobs"] == 2 and up["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x" * 101}, "prompt"),
        ({"prompt": "x", "max_tokens": 4097}, "max_tokens"),
        ({"prompt": "x", "max_tokens": True}, "max_tokens"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": "x", "echo": True}, "echo"),
        ({"prompt": "x", "best_of": 2}, "best_of"),
        ({"prompt": "x", "stop": ["s"] * 33}, "stop"),
        ({"prompt": "x", "seed": 1.5}, "seed"),
        ({"prompt": "x", "temperature": -0.1}, "temperature"),
        ({"prompt": "x", "temperature": 2.5}, "temperature"),
        ({"prompt": "x", "temperature": "hot"}, "temperature"),
        ({"prompt": "x", "temperature": True}, "temperature"),
        ({"prompt": "x", "top_p": "1"}, "top_p"),
    ],
)
def test_invalid_requests_name_the_field(body: dict, param: str) -> None:
    with pytest.raises(ApiError) as exc:
        parse_completion_request(orjson.dumps(body), LIMITS)
    assert exc.value.status == 400 and exc.value.param == param


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("top_p", 0.5),
        ("top_k", 20),
        ("min_p", 0.05),
        ("frequency_penalty", 0.5),
        ("presence_penalty", -0.5),
        ("repetition_penalty", 1.05),
        ("logit_bias", {"42": 5}),
    ],
)
def test_distribution_reshaping_controls_are_refused_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ApiError) as exc:
        parse_completion_request(orjson.dumps({"prompt": "x", field: value}), LIMITS)
    err = exc.value
    assert (err.status, err.param, err.code) == (400, field, "unsupported_sampling_parameter")
    assert f"`{field}`" in err.message and "trainer cannot reproduce" in err.message


def test_neutral_controls_are_accepted_and_temperature_is_pinned() -> None:
    neutral = {"top_p": 1, "top_k": -1, "min_p": 0, "frequency_penalty": 0, "presence_penalty": 0.0}
    req = parse_completion_request(orjson.dumps({"prompt": "x", "seed": 7, "logit_bias": {}, **neutral}), LIMITS)
    up = orjson.loads(upstream_body(req, "m"))
    assert (up["temperature"], up["seed"], up["top_k"], up["top_p"]) == (1.0, 7, 0, 1.0)  # OpenAI default, explicit
    # vLLM's greedy range (< 1e-5) is sent and recorded as exactly 0 (feedback audits it); the rest as asked
    for asked, sent in ((0, 0.0), (1e-6, 0.0), (1e-5, 1e-5), (0.01, 0.01), (0.7, 0.7), (2, 2.0)):
        req = parse_completion_request(orjson.dumps({"prompt": "x", "temperature": asked}), LIMITS)
        assert orjson.loads(upstream_body(req, "m"))["temperature"] == sent
        assert sampling_record(req)["temperature"] == sent
        assert SamplingParams(temperature=sent).greedy == (sent == 0.0)
        floored = with_exploration(req, 0.7)  # routed traffic: the floor lifts greedy requests too
        assert sampling_record(floored)["temperature"] == max(sent, 0.7)


# --- routing ------------------------------------------------------------------------------------------------------
def test_user_hash_is_deterministic_and_hides_the_key() -> None:
    assert user_hash("sk-1") == user_hash("sk-1") != user_hash("sk-2")
    assert "sk-1" not in user_hash("sk-1")


def test_canary_share_splits_users_deterministically() -> None:
    table = PolicyTable(stable=3, candidate=4, canary_share=0.2)
    users = [user_hash(f"k{i}") for i in range(4000)]
    arms = [choose(table, u) for u in users]
    share = sum(1 for a in arms if a == ("candidate", 4)) / len(users)
    assert 0.17 < share < 0.23
    assert arms == [choose(table, u) for u in users]  # same user, same arm
    wider = PolicyTable(stable=3, candidate=4, canary_share=0.5)  # raising the share only moves users to candidate
    assert all(choose(wider, u) == ("candidate", 4) for u, a in zip(users, arms, strict=True) if a[0] == "candidate")
    assert all(0 <= user_point(u) < 1 for u in users)


def test_a_few_user_canary_split_by_request_draws_each_request_and_ignores_the_key() -> None:
    """``split: request`` (a few-user canary, issue 36): the request's draw decides, not the key, so one key reaches
    both arms; by key the draw is ignored. A pin still wins, and the policy table keeps the split through Redis."""
    by_key = PolicyTable(stable=3, candidate=4, canary_share=0.5)
    by_request = by_key.model_copy(update={"split": "request"})
    u = user_hash("sk-lone-developer")
    assert {choose(by_key, u, d) for d in (0.0, 0.49, 0.5, 0.99)} == {choose(by_key, u)}  # one arm for the key
    assert [choose(by_request, u, d) for d in (0.0, 0.49, 0.5, 0.99)] == [("candidate", 4)] * 2 + [("stable", 3)] * 2
    assert (route(by_request, u, {0, 3, 4}, 0.1).arm, route(by_request, u, {0, 3, 4}, 0.9).arm) == (
        "candidate",
        "stable",
    )
    assert choose(by_request.model_copy(update={"pinned": 2}), u, 0.1) == ("pinned", 2)
    assert PolicyTable.from_redis(by_request.to_redis()).split == "request"
    assert PolicyTable.from_redis({"stable": "3"}).split == "key"  # a table written before the field existed


def test_pin_overrides_and_base_is_version_zero() -> None:
    u = user_hash("k")
    assert choose(PolicyTable(stable=3, candidate=4, canary_share=1.0, pinned=2), u) == ("pinned", 2)
    assert choose(PolicyTable(), u) == ("stable", 0)  # the base model as stable is arm stable: the canary reads it


def test_route_falls_back_to_newest_loaded_below() -> None:
    u = user_hash("k")
    assert newest_loaded_at_most(5, {0, 2, 4, 7}) == 4
    assert newest_loaded_at_most(5, {0, 5}) == 5
    assert newest_loaded_at_most(1, {0, 2}) == 0
    r = route(PolicyTable(stable=5), u, {0, 3})
    assert (r.arm, r.version, r.routed_version) == ("stable", 3, 5)
    assert route(PolicyTable(stable=5), u, {0}).arm == "stable"


def test_model_names_round_trip() -> None:
    assert served_model_name("j", "base", 0) == "base"
    assert served_model_name("j", "base", 7) == "j-v7"
    assert served_model_name("j", "base", 7, "full") == "base"
    assert version_of_model("j", "base", "j-v7") == 7 and version_of_model("j", "base", "base") == 0
    assert version_of_model("j", "base", "other-v1") is None


# --- capture ------------------------------------------------------------------------------------------------------
def _chunk(
    text: str,
    ids: list[int],
    lps: list[float],
    offs: list[int],
    finish: str | None = None,
    prompt_ids: list[int] | None = None,
) -> dict:
    return {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 1,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "text": text,
                "logprobs": {
                    "text_offset": offs,
                    "token_logprobs": lps,
                    "tokens": ["?"] * len(ids),
                    "top_logprobs": [{}] * len(ids),
                },
                "finish_reason": finish,
                "stop_reason": None,
                "prompt_token_ids": prompt_ids,
                "token_ids": ids,
            }
        ],
        "kv_transfer_params": None,
    }


def test_accumulator_joins_stream_deltas_even_when_text_lags_tokens() -> None:
    acc = RolloutAccumulator()
    acc.add_choice(_chunk("", [5], [-0.1], [0], prompt_ids=[1, 2])["choices"][0])  # text held back for stop check
    acc.add_choice(_chunk("ab cd", [6, 7], [-0.2, -0.3], [2, 3], "stop")["choices"][0])
    assert acc.consistent()
    rec = acc.to_record(
        tenant="t",
        arm="stable",
        version=2,
        served_model="j-v2",
        user_hash="u",
        prompt="p",
        sampling={"temperature": 0.01, "top_p": None, "max_tokens": 8, "stop": ["x"]},
        created_at=1.0,
        rollout_id="r1",
    )
    assert (rec.completion, rec.completion_token_ids) == ("ab cd", [5, 6, 7])
    assert rec.behaviour_logprobs == [-0.1, -0.2, -0.3]
    assert rec.prompt_token_ids == [1, 2] and rec.token_offsets == [0, 2, 3] and rec.finish_reason == "stop"


def test_client_view_strips_what_was_not_asked() -> None:
    c = _chunk("hi", [5], [-0.1], [0], "length", prompt_ids=[1])
    plain = client_view(c, logprobs=None, token_ids=False)
    assert plain == {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "text": "hi", "finish_reason": "length"}],
    }
    with_lp = client_view(c, logprobs=1, token_ids=False)
    assert with_lp["choices"][0]["logprobs"]["token_logprobs"] == [-0.1]


# --- checkpoints --------------------------------------------------------------------------------------------------
def _publish(root: Path, version: int = 1) -> Announcement:
    d = root / f"v{version}"
    d.mkdir(parents=True)
    (d / "adapter_model.safetensors").write_bytes(b"weights")
    files = {"adapter_model.safetensors": hashlib.sha256(b"weights").hexdigest()}
    m = CheckpointManifest(job="j", version=version, parent_version=0, kind="lora", base_model="b", files=files)
    (d / "manifest.json").write_bytes(m.to_json())
    return Announcement("1-0", version, str(d), "lora", hashlib.sha256(m.to_json()).hexdigest())


def test_verify_checkpoint_accepts_a_good_one(tmp_path: Path) -> None:
    assert verify_checkpoint(_publish(tmp_path), "j").version == 1


@pytest.mark.parametrize(
    ("tamper", "needle"),
    [
        (lambda d: (d / "adapter_model.safetensors").write_bytes(b"other"), "sha256 differs from the manifest"),
        (lambda d: (d / "adapter_model.safetensors").unlink(), "missing"),
        (lambda d: (d / "manifest.json").write_bytes(b"{}"), "announced manifest_sha256"),
    ],
)
def test_verify_checkpoint_refuses_tampering(tmp_path: Path, tamper, needle: str) -> None:
    ann = _publish(tmp_path)
    tamper(Path(ann.path))
    with pytest.raises(CheckpointError, match=needle):
        verify_checkpoint(ann, "j")


def test_verify_checkpoint_refuses_wrong_job_or_tmp_dir(tmp_path: Path) -> None:
    ann = _publish(tmp_path)
    with pytest.raises(CheckpointError, match="announced job=other"):
        verify_checkpoint(ann, "other")
    with pytest.raises(CheckpointError, match="not a published version"):
        verify_checkpoint(Announcement("1-0", 1, str(tmp_path / ".tmp-v1-9"), "lora", ""), "j")


# --- engine command line ------------------------------------------------------------------------------------------
def test_vllm_argv_and_env() -> None:
    cfg = from_mapping(
        {
            "model": {"servedName": "base", "maxModelLen": 4096},
            "trainer": {"maxSeqLen": 4096},  # validated: >= model.maxModelLen
            "serving": {"lora": {"maxRank": 32, "maxLoras": 6}, "vllmArgs": ["--seed", "1"]},
        }
    )
    argv = vllm_argv(cfg, "/m", port=9001, cpu=True)
    joined = " ".join(argv)
    assert "-m vllm.entrypoints.openai.api_server --model /m --served-model-name base --host 127.0.0.1" in joined
    assert "--port 9001 --dtype float32 --max-model-len 4096" in joined
    assert "--enable-lora --max-lora-rank 32 --max-loras 6" in joined and argv[-4:-2] == ["--seed", "1"]
    assert argv[-2:] == ["--logprobs-mode", "processed_logprobs"]  # last: serving.vllmArgs cannot turn it off
    env = vllm_env(cfg, cpu=True)
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True" and int(env["VLLM_MAX_STOP_STRINGS"]) >= 12
    assert "VLLM_SERVER_DEV_MODE" not in env and env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    # CPU: the worker inside the engine-core process (no busy-waiting executor beside the trainer); a user's
    # serving.vllmArgs come after it and win
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert joined.index("--distributed-executor-backend uni") < joined.index("--seed 1")
    assert "--distributed-executor-backend" not in vllm_argv(cfg, "/m", cpu=False)
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in vllm_env(cfg, cpu=False)
    full = from_mapping({"serving": {"weightsMode": "full"}})
    assert "--enable-lora" not in vllm_argv(full, "/m", cpu=False)
    assert "--dtype auto" in " ".join(vllm_argv(full, "/m", cpu=False))
    assert vllm_env(full, cpu=False)["VLLM_SERVER_DEV_MODE"] == "1"


def test_an_engine_runs_the_gateway_inside_only_when_its_config_says_so() -> None:
    """serving.gatewayMode auto leaves the choice to whoever starts the engine: the local stack writes inProcess or
    sidecar into the config it starts engines with; a config left at auto starts a bare engine (a test's, a
    benchmark's) for a gateway of its own."""
    assert "--middleware" not in vllm_argv(from_mapping({}), "/m", cpu=True)
    assert "--middleware" not in vllm_argv(from_mapping({"serving": {"gatewayMode": "sidecar"}}), "/m", cpu=True)
    argv = vllm_argv(from_mapping({"serving": {"gatewayMode": "inProcess"}}), "/m", cpu=True)
    assert argv[argv.index("--middleware") + 1] == "onlinerl_serving.inprocess.InProcessGateway"


def test_exploration_floor_raises_only_lower_temperatures() -> None:
    from onlinerl_serving.requests import CompletionRequest, sampling_record, with_exploration

    req = CompletionRequest(prompt="p", max_tokens=4, stream=True, stop=[], sampling={"temperature": 0.01})
    explored = with_exploration(req, 0.7)
    assert explored.sampling["temperature"] == 0.7 and sampling_record(explored)["temperature"] == 0.7
    assert req.sampling["temperature"] == 0.01  # the original is untouched
    assert with_exploration(req, None) is req
    hot = CompletionRequest(prompt="p", max_tokens=4, stream=True, stop=[], sampling={"temperature": 1.2})
    assert with_exploration(hot, 0.7).sampling["temperature"] == 1.2
    default = CompletionRequest(prompt="p", max_tokens=4, stream=True, stop=[], sampling={})
    assert with_exploration(default, 0.7) is default  # the default temperature is 1.0
    assert sampling_record(default)["temperature"] == 1.0  # recorded as sent, never null
