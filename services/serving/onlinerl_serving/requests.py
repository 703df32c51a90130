"""Validate a client's ``POST /v1/completions`` body and build the body sent to vLLM.

Pure functions. The gateway accepts the OpenAI completions shape that Continue sends (a raw FIM prompt string, a
stop list, ``max_tokens``, ``stream``) and refuses, with a 400 that names the field, what it cannot record faithfully
(``n > 1``, ``best_of``, ``echo``, ``suffix``, a list of prompts). Fields the gateway does not know are ignored.
Upstream it always asks for sampled-token log-probs and token ids: the rollout record needs them.

Sampling controls: the trainer models the behaviour policy as mu = softmax(logits / T) of the served weights (see
onlinerl_trainer.loss), and vLLM runs with ``--logprobs-mode processed_logprobs`` so its log-probs are under that mu.
So a request may set ``temperature`` (and ``seed``) and nothing else that reshapes the distribution: ``top_p``,
``top_k``, ``min_p``, the three penalties and ``logit_bias`` are accepted only at their neutral value and otherwise
refused with a 400 naming the field. Every upstream body sets all of them explicitly (neutral), so a model's
``generation_config.json`` defaults (vLLM applies them to unset fields) never change the distribution behind our back.
Greedy: below vLLM's 1e-5 (:data:`onlinerl.schemas.GREEDY_BELOW`) vLLM takes the argmax, yet reports log-probs at
T = 1: no tempered softmax describes that. Such a request is served greedily as asked (deterministic, what a T = 0
client expects), sent and recorded as temperature 0, and the feedback service audits it instead of training it.
On routed traffic ``serving.explorationTemperature`` raises it first, like any temperature below the floor.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import orjson

from onlinerl.schemas import GREEDY_BELOW
from onlinerl_serving.errors import ApiError, bad_request

MAX_TEMPERATURE = 2.0  # the OpenAI range
# Controls the trainer cannot reproduce: the values that leave softmax(logits / T) unchanged. Always sent upstream.
NEUTRAL_SAMPLING: dict[str, float | int] = {
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
}
_ALSO_NEUTRAL: dict[str, tuple[float | int, ...]] = {"top_k": (-1,)}  # vLLM's older "disabled" spelling
MAX_LOGPROBS = 5
MAX_STOP_SEQUENCES = 32
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 63) - 1


@dataclass(frozen=True)
class Limits:
    """Caps from ``serving.*`` config."""

    max_prompt_chars: int
    max_tokens_cap: int
    max_model_len: int = 1 << 30  # vLLM refuses max_tokens above its context; Continue asks 4096 by default
    default_max_tokens: int = 16  # no max_tokens in the body: OpenAI's legacy completions default


@dataclass
class CompletionRequest:
    """A validated client request: what to generate and what the client wants to see back."""

    prompt: str
    max_tokens: int
    stream: bool
    stop: list[str]
    sampling: dict[str, Any]
    client_logprobs: int | None = None
    include_usage: bool = False
    client_token_ids: bool = False
    user: str = ""
    requested_model: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def parse_completion_request(raw: bytes, limits: Limits) -> CompletionRequest:
    """Parse and validate; raise :class:`ApiError` (400) naming the offending field and the fix."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object", code="invalid_json")

    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise bad_request(
            "`prompt` is required and must be a string (one prompt per request)",
            param="prompt",
            code="missing_required_parameter" if prompt is None else "invalid_type",
        )
    if not prompt:  # vLLM refuses a prompt of no tokens with its own 400, which does not name our field
        raise bad_request("`prompt` must not be empty", param="prompt", code="invalid_value")
    if len(prompt) > limits.max_prompt_chars:
        raise bad_request(
            f"prompt is {len(prompt)} characters, over the cap serving.maxPromptChars="
            f"{limits.max_prompt_chars}: send a shorter prompt (e.g. lower Continue's maxPromptTokens)",
            param="prompt",
            code="prompt_too_long",
        )

    max_tokens = body.get("max_tokens")
    if max_tokens is None:  # OpenAI's legacy completions default (16), not the cap: on CPU the cap runs for minutes
        max_tokens = min(limits.default_max_tokens, limits.max_tokens_cap)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise bad_request("`max_tokens` must be a positive integer", param="max_tokens", code="invalid_type")
    if max_tokens > limits.max_tokens_cap:
        raise bad_request(
            f"max_tokens={max_tokens} is over the cap serving.maxTokensCap={limits.max_tokens_cap}",
            param="max_tokens",
            code="max_tokens_too_large",
        )

    # A request for more than the context can hold is clamped, not refused: generation ends at the context anyway.
    max_tokens = min(max_tokens, limits.max_model_len)

    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("`stream` must be true or false", param="stream", code="invalid_type")

    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad_request("`stop` must be a string or a list of non-empty strings", param="stop", code="invalid_type")
    if len(stop) > MAX_STOP_SEQUENCES:
        raise bad_request(f"`stop` has {len(stop)} entries; at most {MAX_STOP_SEQUENCES}", param="stop")

    sampling = _sampling(body)

    n = body.get("n", 1)
    if n not in (None, 1):
        raise bad_request("only `n: 1` is supported (each completion is recorded as one rollout)", param="n")
    if body.get("best_of") not in (None, 1):
        raise bad_request("`best_of` is not supported", param="best_of")
    if body.get("echo"):
        raise bad_request("`echo: true` is not supported", param="echo")
    if body.get("suffix"):
        raise bad_request(
            "`suffix` is not supported: render the FIM prompt into `prompt` (as Continue does)", param="suffix"
        )

    logprobs = body.get("logprobs")
    if logprobs is not None and (
        not isinstance(logprobs, int) or isinstance(logprobs, bool) or not 0 <= logprobs <= MAX_LOGPROBS
    ):
        raise bad_request(f"`logprobs` must be an integer from 0 to {MAX_LOGPROBS}", param="logprobs")

    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise bad_request("`stream_options` must be an object", param="stream_options", code="invalid_type")
    user = body.get("user") or ""
    if not isinstance(user, str):
        raise bad_request("`user` must be a string", param="user", code="invalid_type")
    model = body.get("model") or ""

    return CompletionRequest(
        prompt=prompt,
        max_tokens=max_tokens,
        stream=stream,
        stop=stop,
        sampling=sampling,
        client_logprobs=logprobs,
        include_usage=bool(stream and stream_options.get("include_usage")),
        client_token_ids=body.get("return_token_ids") is True,
        user=user,
        requested_model=model if isinstance(model, str) else "",
    )


def _sampling(body: dict[str, Any]) -> dict[str, Any]:
    """The supported sampling fields (temperature, seed), checked; any other control must be absent or neutral."""
    temperature = body.get("temperature")
    if temperature is None:
        temperature = 1.0  # the OpenAI default, pinned: vLLM would otherwise take the model's generation_config
    if not _is_number(temperature) or not 0 <= temperature <= MAX_TEMPERATURE:
        raise bad_request(
            f"`temperature` must be a number from 0 to {MAX_TEMPERATURE:g}, got {temperature!r}",
            param="temperature",
            code="invalid_value",
        )
    # vLLM's greedy range is sent as exactly 0: the record then says "greedy" and nobody guesses at 1e-6
    sampling: dict[str, Any] = {"temperature": float(temperature) if temperature >= GREEDY_BELOW else 0.0}
    seed = body.get("seed")
    if seed is not None:
        if not isinstance(seed, int) or isinstance(seed, bool) or not SEED_MIN <= seed <= SEED_MAX:
            # vLLM takes a signed 64-bit seed; past it vLLM's own 400 would not say which field of ours is at fault
            raise bad_request("`seed` must be an integer in the signed 64-bit range", param="seed", code="invalid_type")
        sampling["seed"] = seed
    for name, neutral in NEUTRAL_SAMPLING.items():
        value = body.get(name)
        if value is None:
            continue
        if not _is_number(value):
            raise bad_request(f"`{name}` must be a number", param=name, code="invalid_type")
        if value != neutral and value not in _ALSO_NEUTRAL.get(name, ()):
            raise bad_request(
                f"`{name}`={value!r} is not supported: completions are trained on, and the trainer cannot reproduce "
                f"a distribution reshaped by `{name}` (it models softmax(logits / temperature) only). Omit it or send "
                f"{neutral!r}; use `temperature` to control randomness",
                param=name,
                code="unsupported_sampling_parameter",
            )
    if body.get("logit_bias"):
        raise bad_request(
            "`logit_bias` is not supported: completions are trained on, and the trainer cannot reproduce a biased "
            "distribution. Omit it",
            param="logit_bias",
            code="unsupported_sampling_parameter",
        )
    return sampling


def upstream_body(req: CompletionRequest, served_model: str, stream_interval: int = 1) -> bytes:
    """The JSON body for vLLM: the client's request, routed to ``served_model``, asking for ids and log-probs
    (and, streaming, for tokens in groups of ``stream_interval`` after the first: serving.streamInterval)."""
    body: dict[str, Any] = {
        "model": served_model,
        "prompt": req.prompt,
        "max_tokens": req.max_tokens,
        "stream": req.stream,
        "stop": req.stop,
        "logprobs": req.client_logprobs or 0,  # 0 = the sampled token's log-prob only: the behaviour policy
        "return_token_ids": True,
        **NEUTRAL_SAMPLING,  # explicit, so no server-side default (generation_config) reshapes mu
        **req.sampling,
        "temperature": _temperature(req),  # the value recorded by sampling_record, never vLLM's default
    }
    if req.include_usage:
        body["stream_options"] = {"include_usage": True}
    if req.stream and stream_interval > 1:
        body["stream_interval"] = stream_interval
    return orjson.dumps(body)


def with_exploration(req: CompletionRequest, floor: float | None) -> CompletionRequest:
    """The request with its temperature raised to ``floor`` (serving.explorationTemperature), when that is higher."""
    if floor is None or _temperature(req) >= floor:
        return req
    return replace(req, sampling={**req.sampling, "temperature": float(floor)})


def _temperature(req: CompletionRequest) -> float:
    t = req.sampling.get("temperature")
    if t is None:
        return 1.0
    return float(t) if t >= GREEDY_BELOW else 0.0


def sampling_record(req: CompletionRequest) -> dict[str, Any]:
    """The ``sampling`` part of the rollout record: the temperature exactly as sent to vLLM (after the floor)."""
    return {
        "temperature": _temperature(req),
        "top_p": NEUTRAL_SAMPLING["top_p"],
        "max_tokens": req.max_tokens,
        "stop": list(req.stop),
    }


__all__ = [
    "MAX_TEMPERATURE",
    "NEUTRAL_SAMPLING",
    "ApiError",
    "CompletionRequest",
    "Limits",
    "parse_completion_request",
    "sampling_record",
    "upstream_body",
    "with_exploration",
]
