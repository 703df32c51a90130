"""vLLM's completion handler called as a function, for a non-streaming request of the in-process gateway (issue 40).

In vLLM's process the gateway reached vLLM through vLLM's whole ASGI app: its middleware stack, the router's match
over every route, FastAPI's dependency and body handling (JSON parsed, the request model validated), the route's
``with_cancellation`` (two tasks a request), then ``JSONResponse(response.model_dump())`` encoded the answer, and
the gateway parsed that JSON again. For a non-streaming request all of it is on the user's path, after the
generation, and in vLLM's busy process each step runs with cold caches (bench/RESULTS.md, 2026-12-06).

:class:`DirectCompletions` calls what that route calls, ``OpenAIServingCompletion.create_completion``, with the
request model validated from the same body, and hands the gateway the response's ``model_dump()``: the very dict
the route would have encoded. What the route adds is kept:

- the client leaving aborts the generation (the route's ``with_cancellation``): one watcher task cancels this one;
- an exception becomes vLLM's own error answer (``create_error_response``, as vLLM's exception handlers do);
- a body the request model refuses, and anything else this path does not take (streams, server-load tracking),
  goes through vLLM's ASGI app as before, so every error is worded by vLLM itself.

vLLM's HTTP middleware does not see these requests (its per-route HTTP metrics); the engine's own metrics count
them as before. Tied to vLLM's internal serving API as read in the releases of ``vllm_plugin.READ_AGAINST``: on any
other vLLM (an upstream GPU image's, say), or where that API is missing, :meth:`DirectCompletions.for_app` returns
None and the gateway keeps the ASGI path, since a changed signature would fail every request rather than one.
``ONLINERL_INPROCESS_DIRECT=0`` turns it off.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass
from typing import Any

import orjson

from onlinerl.asgi import Receive

log = logging.getLogger("onlinerl.gateway.inprocess")

DIRECT_ENV = "ONLINERL_INPROCESS_DIRECT"


def vllm_version() -> str:
    try:
        import vllm
    except ImportError:
        return "(none)"
    return str(getattr(vllm, "__version__", "(unknown)"))


@dataclass(slots=True)
class DirectAnswer:
    """What vLLM answered: ``payload`` (status 200, the response's dict), else ``body`` (vLLM's error JSON);
    ``client_left`` when the client went away and the generation was aborted (nothing else is set then)."""

    status: int = 0
    payload: dict[str, Any] | None = None
    body: bytes = b""
    client_left: bool = False


class DirectCompletions:
    """``create_completion`` of vLLM's serving object, called from the gateway's own task."""

    def __init__(self, serving: Any, request_model: Any, response_model: Any, error_model: Any, to_error: Any) -> None:
        self.serving = serving
        self.request_model = request_model  # vLLM's CompletionRequest
        self.response_model = response_model  # CompletionResponse
        self.error_model = error_model  # ErrorResponse
        self.to_error = to_error  # create_error_response: an exception as vLLM's exception handlers answer it

    @classmethod
    def for_app(cls, app: Any) -> DirectCompletions | None:
        """The direct path over vLLM's FastAPI ``app`` (its ``state`` holds the serving objects once started), or
        None (logged) where it must not or cannot be taken: the ASGI path then serves every request."""
        if os.environ.get(DIRECT_ENV, "1") == "0":
            log.info("%s=0: non-streaming completions go through vLLM's HTTP route", DIRECT_ENV)
            return None
        state = getattr(app, "state", None)
        serving = getattr(state, "openai_serving_completion", None)
        if serving is None or not hasattr(serving, "create_completion"):
            log.info("vLLM's completion handler is not reachable here: its HTTP route serves every completion")
            return None
        if getattr(state, "enable_server_load_tracking", False):  # the route's load_aware_call counts requests
            log.info("vLLM tracks server load per route: completions go through its HTTP route")
            return None
        from onlinerl_serving.vllm_plugin import READ_AGAINST  # here: the plugin module imports torch

        version = vllm_version()
        if not version.startswith(READ_AGAINST):
            log.info(
                "vLLM %s is not a release its serving API was read against %s: its HTTP route serves",
                version,
                READ_AGAINST,
            )
            return None
        try:
            from vllm.entrypoints.openai.completion.protocol import CompletionRequest, CompletionResponse
            from vllm.entrypoints.serve.engine.protocol import ErrorResponse
            from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
        except ImportError as exc:  # another vLLM's layout
            log.info("vLLM's completion types are not where 0.32 has them (%s): its HTTP route serves", exc)
            return None
        return cls(serving, CompletionRequest, CompletionResponse, ErrorResponse, create_error_response)

    def request_of(self, body: bytes) -> Any | None:
        """vLLM's request model of a non-streaming body, validated as FastAPI does (a parsed dict); None when it
        must take the route instead: a stream, or a body the model refuses (vLLM words that 400 itself)."""
        try:
            request = self.request_model.model_validate(orjson.loads(body))
        except ValueError:  # orjson's and pydantic's errors are both ValueErrors
            return None
        return None if request.stream else request

    async def complete(self, request: Any, client_receive: Receive) -> DirectAnswer:
        """Run vLLM's handler in this task; ``client_receive`` (the client's, its body already read) is watched,
        and the client's leaving cancels the handler as the route's ``with_cancellation`` does."""
        me = asyncio.current_task()
        assert me is not None
        cancels_before = me.cancelling()
        left = False

        async def cancel_when_the_client_leaves() -> None:
            nonlocal left
            while (await client_receive())["type"] != "http.disconnect":
                pass
            left = True
            me.cancel()

        watcher = asyncio.ensure_future(cancel_when_the_client_leaves())
        try:
            result = await self.serving.create_completion(request, None)
        except asyncio.CancelledError:
            if not left:
                raise  # a timeout or a shutdown: not ours to swallow
            result = None
        except Exception as exc:
            err = self.to_error(exc)
            return DirectAnswer(err.error.code, body=orjson.dumps(err.model_dump()))
        finally:
            watcher.cancel()
        if left:
            me.uncancel()  # the cancel was the watcher's (vLLM may have turned it into an error answer)
            return DirectAnswer(client_left=True)
        if me.cancelling() > cancels_before:
            raise asyncio.CancelledError  # cancelled from outside, and vLLM answered instead of raising
        if isinstance(result, self.error_model):
            return DirectAnswer(result.error.code, body=orjson.dumps(result.model_dump()))
        if isinstance(result, self.response_model):
            return DirectAnswer(200, payload=result.model_dump())
        # A stream for a non-streaming request (vLLM would send it as SSE): not expected; say so rather than guess.
        raise TypeError(f"vLLM's create_completion answered a non-streaming request with {type(result).__name__}")
