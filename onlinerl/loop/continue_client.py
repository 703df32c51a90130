"""Requests exactly as Continue sends them: the streaming FIM completion and the completion-tracking upload.

Shapes follow ../shared/reference/continue-client.md: Continue renders the FIM prompt itself, always streams, sends
both ``Authorization: Bearer`` and ``api-key``, and uploads an AutocompleteOutcome with the *shown* text.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime

import httpx
import orjson

from onlinerl.fim import FimTemplate

CONTINUE_TEMPERATURE = 0.01
POLICY_VERSION_HEADER = "x-onlinerl-policy-version"
ARM_HEADER = "x-onlinerl-arm"
PIN_VERSION_HEADER = "X-OnlineRL-Version"
# The policy line a pinned version is on (issue 39): an eval key of project P pins a version of P's own line with it
# (the gateway refuses another project's); absent, the shared line. The gateway answers with the line that served.
PIN_LINE_HEADER = "X-OnlineRL-Line"
LINE_HEADER = "x-onlinerl-line"


@dataclass
class CompletionResult:
    text: str = ""
    status: int = 0
    error: str = ""
    version: int | None = None
    arm: str = ""
    line: str | None = None  # the policy line that served it (None: the gateway did not say)
    ttft_ms: float | None = None
    latency_ms: float = 0.0
    finish_reason: str | None = None
    chunks: int = 0

    @property
    def failed(self) -> bool:
        return self.status != 200 or bool(self.error)


@dataclass
class UploadResult:
    """An upload's final answer and how many tries it took (retries show an outage the client waited out)."""

    status: int  # 0: no answer before the retry deadline
    reply: dict
    attempts: int = 1


@dataclass
class ContinueClient:
    """One simulated editor installation (its own ``uniqueId``) talking to the gateway and the feedback service."""

    api_base: str  # e.g. http://127.0.0.1:8000/v1
    tracking_url: str  # e.g. http://127.0.0.1:8002/api/training/submit
    api_key: str
    project: str
    model: str
    template: FimTemplate
    max_tokens: int = 64
    unique_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    pin_line: str = ""  # the line of the versions it pins ('' = the shared line; else its own project's)

    def completion_body(self, prompt: str) -> dict:
        return {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": self.max_tokens,
            "temperature": CONTINUE_TEMPERATURE,
            "stop": list(self.template.stop),
            "stream": True,
        }

    def headers(self, pin_version: int | None = None) -> dict[str, str]:
        h = {"Authorization": f"Bearer {self.api_key}", "api-key": self.api_key, "Content-Type": "application/json"}
        if pin_version is not None:
            h[PIN_VERSION_HEADER] = str(pin_version)
            if self.pin_line:
                h[PIN_LINE_HEADER] = self.pin_line
        return h

    async def complete(self, http: httpx.AsyncClient, prompt: str, pin_version: int | None = None) -> CompletionResult:
        """Stream one completion; parse SSE like Continue (``choices[0].text`` until ``data: [DONE]``)."""
        res = CompletionResult()
        t0 = time.perf_counter()
        try:
            async with http.stream(
                "POST",
                f"{self.api_base}/completions",
                headers=self.headers(pin_version),
                content=orjson.dumps(self.completion_body(prompt)),
            ) as r:
                res.status = r.status_code
                if r.headers.get(POLICY_VERSION_HEADER):
                    res.version = int(r.headers[POLICY_VERSION_HEADER])
                res.arm = r.headers.get(ARM_HEADER, "")
                res.line = r.headers.get(LINE_HEADER)
                if r.status_code != 200:
                    res.error = (await r.aread()).decode(errors="replace")[:500]
                    return res
                done = False
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        done = True
                        break
                    chunk = orjson.loads(data)
                    if "error" in chunk:
                        res.error = str(chunk["error"])
                        break
                    choice = chunk["choices"][0]
                    if res.ttft_ms is None:
                        res.ttft_ms = (time.perf_counter() - t0) * 1000
                    res.text += choice.get("text") or ""
                    res.finish_reason = choice.get("finish_reason") or res.finish_reason
                    res.chunks += 1
                if not done and not res.error:
                    res.error = "stream ended without data: [DONE]"
        except httpx.HTTPError as exc:
            res.error = f"{type(exc).__name__}: {exc}"
        finally:
            res.latency_ms = (time.perf_counter() - t0) * 1000
        return res

    def outcome(
        self, *, prompt: str, prefix: str, suffix: str, filepath: str, shown: str, accepted: bool, latency_ms: float
    ) -> dict:
        """An AutocompleteOutcome body as the RLinf Continue fork uploads it (with a few extra options spread in)."""
        return {
            "completionId": str(uuid.uuid4()),
            "filepath": filepath,
            "prefix": prefix,
            "suffix": suffix,
            "prompt": prompt,
            "completion": shown,
            "modelProvider": "openai",
            "modelName": self.model,
            "accepted": accepted,
            "timestamp": datetime.now(UTC).isoformat().replace("+00:00", "Z"),
            "time": round(latency_ms),
            "uniqueId": self.unique_id,
            "numLines": shown.count("\n") + 1 if shown else 0,
            "cacheHit": False,
            "completionOptions": {"maxTokens": self.max_tokens, "temperature": CONTINUE_TEMPERATURE},
            "enabledStaticContextualization": False,
            "debounceDelay": 350,
            "multilineCompletions": "auto",
        }

    async def post_outcome(self, http: httpx.AsyncClient, body: dict, retry_for_s: float = 30.0) -> tuple[int, dict]:
        """Upload with Continue's headers; see :meth:`upload`."""
        up = await self.upload(http, body, retry_for_s)
        return up.status, up.reply

    async def upload(self, http: httpx.AsyncClient, body: dict, retry_for_s: float = 30.0) -> UploadResult:
        """Upload, retrying a refused connection and 429/503 (after Retry-After) for up to ``retry_for_s`` seconds:
        backpressure and a feedback service restarting after a crash are waited out, not dropped. Retrying the same
        completionId is safe: the service answers ``duplicate`` with the entry that counted."""
        headers = {
            "Authorization": f"Bearer {self.api_key}",
            "X-Project-ID": self.project,
            "Content-Type": "application/json",
        }
        deadline = time.monotonic() + retry_for_s
        attempt = 0
        while True:
            attempt += 1
            try:
                r = await http.post(self.tracking_url, content=orjson.dumps(body), headers=headers)
            except httpx.HTTPError as exc:
                wait = min(2.0, 0.25 * 2 ** (attempt - 1))
                if time.monotonic() + wait > deadline:
                    return UploadResult(0, {"error": f"{type(exc).__name__}: {exc}"}, attempt)
                await asyncio.sleep(wait)
                continue
            if r.status_code in (429, 503):
                wait = float(r.headers.get("retry-after", "1"))
                if time.monotonic() + wait <= deadline:
                    await asyncio.sleep(wait)
                    continue
            try:
                return UploadResult(r.status_code, r.json(), attempt)
            except ValueError:
                return UploadResult(r.status_code, {"raw": r.text[:200]}, attempt)
