"""vLLM's admin routes, as used by the reloader: model list, LoRA load/unload, warm-up, full-weight reload.

All of these live on vLLM's loopback port only (docs/architecture.md). Each call raises :class:`EngineError` with
vLLM's own message, so the reloader can record why a version failed.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import httpx

WARMUP_PROMPT = "def main():\n    "


class EngineError(RuntimeError):
    """vLLM refused or could not be reached; the message carries its answer."""


class EngineAdmin:
    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client

    async def _post(
        self,
        path: str,
        body: dict[str, Any] | None = None,
        params: dict[str, str] | None = None,
        timeout: float | None = None,
    ) -> httpx.Response:
        try:
            kwargs: dict[str, Any] = {"params": params}
            if timeout is not None:
                kwargs["timeout"] = timeout
            resp = await self.client.post(path, json=body, **kwargs)
        except httpx.HTTPError as exc:
            raise EngineError(f"POST {path}: {type(exc).__name__}: {exc}") from None
        return resp

    async def models(self) -> set[str]:
        """Names vLLM serves now (the base model and every loaded adapter)."""
        try:
            resp = await self.client.get("/v1/models")
            resp.raise_for_status()
        except httpx.HTTPError as exc:
            raise EngineError(f"GET /v1/models: {type(exc).__name__}: {exc}") from None
        return {m["id"] for m in resp.json().get("data", ())}

    async def load_lora(self, name: str, path: str) -> None:
        """Load an adapter under a new name (never ``load_inplace``: a loaded name is immutable)."""
        resp = await self._post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
        if resp.status_code == 400 and "already been loaded" in resp.text:
            return  # loaded by an earlier life of this reloader: same name means same immutable directory
        if resp.status_code != 200:
            raise EngineError(f"load_lora_adapter {name} from {path}: HTTP {resp.status_code}: {resp.text[:500]}")

    async def unload_lora(self, name: str) -> None:
        resp = await self._post("/v1/unload_lora_adapter", {"lora_name": name})
        if resp.status_code not in (200, 404):
            raise EngineError(f"unload_lora_adapter {name}: HTTP {resp.status_code}: {resp.text[:500]}")

    async def warm_up(self, model: str) -> None:
        """One short greedy completion: the version must answer before any user is routed to it."""
        resp = await self._post(
            "/v1/completions", {"model": model, "prompt": WARMUP_PROMPT, "max_tokens": 2, "temperature": 0.0}
        )
        if resp.status_code != 200:
            raise EngineError(f"warm-up of {model}: HTTP {resp.status_code}: {resp.text[:500]}")

    async def reload_full_weights(
        self,
        weights_path: str,
        before_resume: Callable[[], Awaitable[None]] | None = None,
        timeout: float = 600.0,
    ) -> None:
        """Full-weight mode over the dev routes: pause (drain), reload_weights from ``weights_path``, always resume.

        ``before_resume`` runs only after a successful reload, while vLLM is still paused: whatever it records (the
        version now held) is true before vLLM serves a single token with the new weights."""
        resp = await self._post("/pause", params={"mode": "wait"}, timeout=timeout)
        if resp.status_code != 200:
            raise EngineError(f"pause: HTTP {resp.status_code}: {resp.text[:500]}")
        try:
            resp = await self._post(
                "/collective_rpc",
                {"method": "reload_weights", "kwargs": {"weights_path": weights_path}},
                timeout=timeout,
            )
            if resp.status_code != 200:
                raise EngineError(f"reload_weights from {weights_path}: HTTP {resp.status_code}: {resp.text[:500]}")
            if before_resume is not None:
                await before_resume()
        finally:
            resume = await self._post("/resume", timeout=timeout)
            if resume.status_code != 200:
                raise EngineError(f"resume: HTTP {resume.status_code}: {resume.text[:500]}")
