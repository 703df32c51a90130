"""vLLM's completion handler called as a function (``vllm_completions.DirectCompletions``, issue 40), with vLLM's own
request, response and error types and its ``create_error_response``; a stand-in for the serving object whose
``create_completion`` behaves as vLLM 0.32's does (it turns a cancellation during the generation into an error
answer). Through real vLLM: tests/loop/test_replicas_e2e.py (the same answer as vLLM's HTTP route, and a client
that leaves aborts the generation).

Asserted: the answer is the response's ``model_dump()`` (what vLLM's route encodes) and reaches the gateway as a dict;
vLLM's error answers and exceptions keep vLLM's status and wording; a stream or a body vLLM's model refuses takes
vLLM's HTTP route; the client leaving aborts the generation and leaves the gateway's task uncancelled; a timeout
stays a timeout even though vLLM answers its cancellation; the path is off where it must be.
"""

from __future__ import annotations

import asyncio
import types
from http import HTTPStatus

import orjson
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from vllm.entrypoints.openai.completion.protocol import CompletionResponse, CompletionResponseChoice
from vllm.entrypoints.serve.engine.protocol import UsageInfo
from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

from onlinerl_serving import vllm_completions
from onlinerl_serving.inprocess import InProcessEngine
from onlinerl_serving.vllm_completions import DIRECT_ENV, DirectCompletions

BODY = orjson.dumps(
    {"model": "m", "prompt": "def f(", "max_tokens": 4, "logprobs": 0, "return_token_ids": True, "temperature": 0.7}
)


class StandInServing:
    """``OpenAIServingCompletion.create_completion`` as the direct path calls it, one behaviour per test."""

    def __init__(self, behaviour: str = "answer") -> None:
        self.behaviour = behaviour
        self.calls: list[tuple[object, object]] = []
        self.aborted = asyncio.Event()

    async def create_completion(self, request, raw_request):
        self.calls.append((request, raw_request))
        if self.behaviour == "answer":
            choice = CompletionResponseChoice(index=0, text="x)", token_ids=[87, 8], finish_reason="length")
            return CompletionResponse(model=request.model, choices=[choice], usage=UsageInfo(prompt_tokens=3))
        if self.behaviour == "not found":
            return create_error_response("The model `m` does not exist.", "NotFoundError", HTTPStatus.NOT_FOUND)
        if self.behaviour == "raises":
            raise ValueError("max_tokens must be at least 1")
        try:  # "slow": generating until cancelled, then what vLLM 0.32 does (serving.py: "Client disconnected")
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.aborted.set()
            return create_error_response("Client disconnected")
        raise AssertionError("unreachable")


def direct(serving: StandInServing) -> DirectCompletions:
    app = types.SimpleNamespace(state=types.SimpleNamespace(openai_serving_completion=serving))
    found = DirectCompletions.for_app(app)
    assert found is not None
    return found


async def staying_client() -> dict:
    await asyncio.sleep(3600)
    return {"type": "http.disconnect"}


def test_the_answer_is_the_response_dict_vllms_route_would_encode() -> None:
    serving = StandInServing()
    d = direct(serving)

    async def go():
        request = d.request_of(BODY)
        assert request is not None and (request.model, request.max_tokens, request.logprobs) == ("m", 4, 0)
        return await d.complete(request, staying_client), asyncio.current_task().cancelling()

    answer, cancelling = asyncio.run(go())
    assert answer.status == 200 and not answer.client_left and cancelling == 0
    assert answer.payload["choices"][0]["text"] == "x)" and answer.payload["choices"][0]["token_ids"] == [87, 8]
    assert answer.payload["usage"]["prompt_tokens"] == 3 and answer.payload["model"] == "m"
    assert serving.calls[0][1] is None  # no HTTP request object: headers such as X-Request-Id are vLLM's defaults


@pytest.mark.parametrize(
    ("behaviour", "status", "wording"),
    [("not found", 404, "does not exist"), ("raises", 400, "max_tokens must be at least 1")],
)
def test_vllms_errors_keep_their_status_and_wording(behaviour: str, status: int, wording: str) -> None:
    d = direct(StandInServing(behaviour))
    answer = asyncio.run(d.complete(d.request_of(BODY), staying_client))
    assert answer.status == status and answer.payload is None
    assert wording in orjson.loads(answer.body)["error"]["message"]
    assert orjson.loads(answer.body)["error"]["code"] == status  # vLLM's OpenAI error shape


@pytest.mark.parametrize(
    "body",
    [
        orjson.dumps({"model": "m", "prompt": "x", "stream": True}),  # a stream: vLLM's route relays it
        orjson.dumps({"model": "m", "prompt": "x", "max_tokens": "lots"}),  # refused by vLLM's model: its 400
        orjson.dumps({"model": "m", "prompt": "x", "logprobs": 0, "echo": True, "n": "two"}),
        b"{not json",
    ],
)
def test_a_stream_or_a_body_vllm_refuses_takes_vllms_own_route(body: bytes) -> None:
    assert direct(StandInServing()).request_of(body) is None


def test_a_client_that_leaves_aborts_the_generation_and_leaves_the_task_uncancelled() -> None:
    serving = StandInServing("slow")
    d = direct(serving)

    async def go():
        left = asyncio.Event()

        async def client_receive() -> dict:
            await left.wait()
            return {"type": "http.disconnect"}

        work = asyncio.ensure_future(d.complete(d.request_of(BODY), client_receive))
        await asyncio.sleep(0.01)
        left.set()
        answer = await work
        return answer, work.cancelling(), serving.aborted.is_set()

    answer, cancelling, aborted = asyncio.run(go())
    assert answer.client_left and aborted and cancelling == 0


def test_a_timeout_stays_a_timeout_though_vllm_answers_its_cancellation() -> None:
    """vLLM turns a cancellation into an error answer; a timeout's cancellation must still end as TimeoutError
    (the gateway's 504), never as vLLM's "Client disconnected" 400 relayed to a client that is still there."""
    serving = StandInServing("slow")
    d = direct(serving)

    async def go() -> None:
        async with asyncio.timeout(0.05):
            await d.complete(d.request_of(BODY), staying_client)

    with pytest.raises(TimeoutError):
        asyncio.run(go())
    assert serving.aborted.is_set()


def test_the_direct_path_is_off_where_it_must_be(monkeypatch: pytest.MonkeyPatch) -> None:
    serving = StandInServing()
    state = types.SimpleNamespace(openai_serving_completion=serving)
    assert DirectCompletions.for_app(types.SimpleNamespace(state=state)) is not None
    assert DirectCompletions.for_app(types.SimpleNamespace(state=types.SimpleNamespace())) is None  # no handler
    assert DirectCompletions.for_app(object()) is None
    tracked = types.SimpleNamespace(openai_serving_completion=serving, enable_server_load_tracking=True)
    assert DirectCompletions.for_app(types.SimpleNamespace(state=tracked)) is None  # the route counts the load
    monkeypatch.setenv(DIRECT_ENV, "0")
    assert DirectCompletions.for_app(types.SimpleNamespace(state=state)) is None
    monkeypatch.delenv(DIRECT_ENV)
    # Another vLLM release (an upstream GPU image's): its serving API was not read, so a changed signature must not
    # fail every request; the route serves.
    monkeypatch.setattr(vllm_completions, "vllm_version", lambda: "0.99.0")
    assert DirectCompletions.for_app(types.SimpleNamespace(state=state)) is None


def test_the_in_process_engine_takes_the_direct_path_for_completions_and_vllms_app_for_the_rest() -> None:
    """``InProcessEngine.post_whole``: a completion comes back as vLLM's dict (``via`` direct; its bytes only if
    someone reads them); a body the direct path does not take, and any other path, go through vLLM's ASGI app."""
    seen: list[bytes] = []

    async def route(request: Request):
        seen.append(await request.body())
        return JSONResponse({"route": request.url.path}, status_code=400)

    app = Starlette(routes=[Route("/v1/completions", route, methods=["POST"]), Route("/x", route, methods=["POST"])])
    engine = InProcessEngine(app, read_timeout=5)
    engine.direct = direct(StandInServing())

    async def go():
        resp = await engine.post_whole("/v1/completions", BODY, staying_client)
        payload = await resp.json()
        assert (resp.status_code, resp.via, payload["choices"][0]["text"]) == (200, "direct", "x)")
        assert orjson.loads(await resp.read()) == payload
        refused = orjson.dumps({"model": "m", "prompt": "x", "max_tokens": "lots"})
        for path, body in (("/v1/completions", refused), ("/x", BODY)):
            resp = await engine.post_whole(path, body, staying_client)
            assert (resp.status_code, resp.via, await resp.json()) == (400, "asgi", {"route": path})

    asyncio.run(go())
    assert len(seen) == 2
