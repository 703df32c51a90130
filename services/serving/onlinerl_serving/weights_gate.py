"""Full-weight mode: the version vLLM's one model holds, as this gateway knows it, and a gate shut while it changes.

Why a gate: a request's version is fixed when the gateway sends it to vLLM (response header, rollout record). If the
weights changed under requests already sent (or queued inside a paused vLLM), they would be served by one version and
recorded as another. So the reloader of this pod tells the gateway (``POST /internal/weights``):

* ``switching``: the gate shuts (new requests wait here), and the call returns once every request this gateway sent
  to vLLM has finished; only then does the reloader pause vLLM and reload its weights;
* ``serving`` + version: the weights are in place and warm; waiting requests go, labelled with that version;
* ``unknown``: vLLM restarted or a reload failed; requests wait until the reloader says what vLLM holds.

A gateway that has not heard from the reloader yet (just started) knows nothing: it waits the same way.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from onlinerl.http_errors import error_body


class WeightsUnknown(TimeoutError):
    """No version became known within the caller's timeout (the reloader is switching, or has not reported)."""


class WeightsGate:
    def __init__(self) -> None:
        self.version: int | None = None
        self.switching = False
        self.inflight = 0
        self._open = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def known(self) -> bool:
        return self.version is not None and not self.switching

    async def enter(self, timeout: float) -> int:
        """Wait for known weights (at most ``timeout`` s), count this request in flight and return the version."""
        deadline = time.monotonic() + timeout
        while not self.known:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WeightsUnknown(f"model weights not known after {timeout:.0f}s")
            try:
                await asyncio.wait_for(self._open.wait(), left)
            except TimeoutError:
                continue
        self.inflight += 1
        self._idle.clear()
        assert self.version is not None
        return self.version

    def leave(self) -> None:
        self.inflight -= 1
        if self.inflight <= 0:
            self.inflight = 0
            self._idle.set()

    async def shut(self, drain_timeout: float) -> bool:
        """Stop sending requests to vLLM and wait for those already sent; False if some remain after the timeout."""
        self.switching = True
        self._open.clear()
        try:
            await asyncio.wait_for(self._idle.wait(), drain_timeout)
            return True
        except TimeoutError:
            return False

    def open(self, version: int | None) -> None:
        """vLLM holds ``version`` (None: unknown, keep requests waiting)."""
        self.version = version
        self.switching = False
        if version is None:
            self._open.clear()
        else:
            self._open.set()

    def view(self) -> dict[str, object]:
        return {"version": self.version, "switching": self.switching, "inflight": self.inflight}


def weights_endpoint(gate: WeightsGate, loopback: set[str]) -> Callable[[Request], Awaitable[Response]]:
    """``GET|POST /internal/weights``: this pod's reloader drives the gate (loopback only, like /internal/inflight).

    POST ``{"state": "switching", "drainTimeoutSeconds": s}`` answers ``{"drained": bool, ...}`` once drained;
    ``{"state": "serving", "version": N}``; ``{"state": "unknown"}``. GET answers the gate's view."""

    async def endpoint(request: Request) -> Response:
        if (request.client.host if request.client else "") not in loopback:
            return Response(status_code=404)
        if request.method == "GET":
            return JSONResponse(gate.view())
        try:
            body = orjson.loads(await request.body())
        except orjson.JSONDecodeError:
            return _bad('body must be a JSON object like {"state": "serving", "version": 3}', "body")
        if not isinstance(body, dict) or body.get("state") not in ("switching", "serving", "unknown"):
            return _bad("state must be one of switching, serving, unknown", "state")
        if body["state"] == "switching":
            timeout = body.get("drainTimeoutSeconds", 120)
            if not isinstance(timeout, int | float) or isinstance(timeout, bool) or not 0 <= timeout <= 3600:
                return _bad("drainTimeoutSeconds must be a number of seconds in [0, 3600]", "drainTimeoutSeconds")
            drained = await gate.shut(float(timeout))
            return JSONResponse({"drained": drained, **gate.view()})
        if body["state"] == "serving":
            version = body.get("version")
            if not isinstance(version, int) or isinstance(version, bool) or version < 0:
                return _bad("version must be a non-negative integer (the version vLLM holds)", "version")
            gate.open(version)
        else:
            gate.open(None)
        return JSONResponse(gate.view())

    return endpoint


def _bad(message: str, param: str) -> Response:
    return JSONResponse(error_body(message, param=param), 400)
