"""Full-weight mode: the version vLLM's one model holds, as this gateway knows it, and a gate shut while it changes.

Why a gate: a request's version is fixed when the gateway sends it to vLLM (response header, rollout record). If the
weights changed under requests already sent (or queued inside a paused vLLM), they would be served by one version and
recorded as another. So the reloader of this pod tells the gateway (``POST /internal/weights``):

* ``switching``: the gate shuts (new requests wait here), and the call returns once every request this gateway sent
  to vLLM has finished; only then does the reloader pause vLLM and reload its weights;
* ``serving`` + version: the weights are in place and warm; waiting requests go, labelled with that version;
* ``previewing`` + version: the eval gate's preview (full-weight mode's gate, see onlinerl_rollout.controller): the
  weights are a candidate that no user has been given; only evaluation requests pinned to it (an eval/admin key with
  ``X-OnlineRL-Version``) go, labelled arm ``eval``; user requests keep waiting until ``serving`` (the candidate passed:
  everyone gets it, labelled ``candidate``) or until the weights are switched back to stable;
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
        self.previewing = False  # the weights are a candidate under the gate's preview: eval requests only
        self.inflight = 0
        self._changed = asyncio.Event()  # set (and replaced) on every state change: waiters look again
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def known(self) -> bool:
        return self.version is not None and not self.switching

    def admits(self, forced: int | None = None) -> bool:
        """Whether a request may go now: known weights, and during a preview only one pinned to the previewed
        version (``forced``: its X-OnlineRL-Version, already checked to come from an eval or admin key)."""
        return self.known and (not self.previewing or forced == self.version)

    async def enter(self, timeout: float, forced: int | None = None) -> int:
        """Wait until this request may go (at most ``timeout`` s), count it in flight and return the version."""
        deadline = time.monotonic() + timeout
        while not self.admits(forced):
            left = deadline - time.monotonic()
            if left <= 0:
                why = "held for the eval gate's preview" if self.previewing else "not known"
                raise WeightsUnknown(f"model weights {why} after {timeout:.0f}s")
            changed = self._changed
            try:
                await asyncio.wait_for(changed.wait(), left)
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
        self._notify()
        try:
            await asyncio.wait_for(self._idle.wait(), drain_timeout)
            return True
        except TimeoutError:
            return False

    def open(self, version: int | None, preview: bool = False) -> None:
        """vLLM holds ``version`` (None: unknown, keep requests waiting); ``preview``: for eval requests only."""
        self.version = version
        self.switching = False
        self.previewing = preview and version is not None
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def view(self) -> dict[str, object]:
        return {
            "version": self.version,
            "switching": self.switching,
            "previewing": self.previewing,
            "inflight": self.inflight,
        }


def weights_endpoint(
    gate: WeightsGate, loopback: set[str], before_serving: Callable[[], Awaitable[None]] | None = None
) -> Callable[[Request], Awaitable[Response]]:
    """``GET|POST /internal/weights``: this pod's reloader drives the gate (loopback only, like /internal/inflight).

    POST ``{"state": "switching", "drainTimeoutSeconds": s}`` answers ``{"drained": bool, ...}`` once drained;
    ``{"state": "serving", "version": N}``; ``{"state": "previewing", "version": N}``; ``{"state": "unknown"}``. GET
    answers the gate's view. ``before_serving`` runs before users are let in (the gateway re-reads the policy table:
    after a preview passes, the same weights serve everyone and must be labelled by the table that says so)."""

    async def endpoint(request: Request) -> Response:
        if (request.client.host if request.client else "") not in loopback:
            return Response(status_code=404)
        if request.method == "GET":
            return JSONResponse(gate.view())
        try:
            body = orjson.loads(await request.body())
        except orjson.JSONDecodeError:
            return _bad('body must be a JSON object like {"state": "serving", "version": 3}', "body")
        if not isinstance(body, dict) or body.get("state") not in ("switching", "serving", "previewing", "unknown"):
            return _bad("state must be one of switching, serving, previewing, unknown", "state")
        if body["state"] == "switching":
            timeout = body.get("drainTimeoutSeconds", 120)
            if not isinstance(timeout, int | float) or isinstance(timeout, bool) or not 0 <= timeout <= 3600:
                return _bad("drainTimeoutSeconds must be a number of seconds in [0, 3600]", "drainTimeoutSeconds")
            drained = await gate.shut(float(timeout))
            return JSONResponse({"drained": drained, **gate.view()})
        if body["state"] in ("serving", "previewing"):
            version = body.get("version")
            if not isinstance(version, int) or isinstance(version, bool) or version < 0:
                return _bad("version must be a non-negative integer (the version vLLM holds)", "version")
            if body["state"] == "serving" and before_serving is not None:
                await before_serving()
            gate.open(version, preview=body["state"] == "previewing")
        else:
            gate.open(None)
        return JSONResponse(gate.view())

    return endpoint


def _bad(message: str, param: str) -> Response:
    return JSONResponse(error_body(message, param=param), 400)
