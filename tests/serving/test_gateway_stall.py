"""A real gateway in front of an engine that starts a stream and then goes silent: the client must get an error
event, never a 200 body that ends like a finished suggestion (the partial text is not a completion)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from onlinerl.valkey import EmbeddedValkey, free_port
from tests.serving.conftest import KEY_ACME, Gateway, gateway_in_front_of

CHUNK = orjson.dumps({"id": "c1", "object": "text_completion", "choices": [{"index": 0, "text": "return a"}]})


class StallingEngine:
    """An HTTP/1.1 server that answers every completion with SSE headers and one event, then sends nothing."""

    def __init__(self) -> None:
        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.ready.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", self.port))
        self.ready.set()
        self.loop.run_forever()
        server.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(ln.split(b":")[1]) for ln in head.lower().split(b"\r\n") if ln.startswith(b"content-length"))
        await reader.readexactly(length)
        event = b"data: " + CHUNK + b"\n\n"
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
            + f"{len(event):x}\r\n".encode()
            + event
            + b"\r\n"
        )
        await writer.drain()
        await asyncio.sleep(3600)  # silent, connection open

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture(scope="module")
def stalled_gateway(
    tmp_path_factory: pytest.TempPathFactory, module_valkey: EmbeddedValkey, keys_file: Path
) -> Iterator[Gateway]:
    engine = StallingEngine()
    gw = gateway_in_front_of(
        tmp_path_factory.mktemp("gw-stall"),
        module_valkey.url,
        keys_file,
        f"http://127.0.0.1:{engine.port}",
        requestTimeoutSeconds=1.5,
    )
    try:
        yield gw
    finally:
        gw.child.stop()
        engine.stop()


def test_an_engine_silent_mid_stream_ends_in_an_error_event_not_a_finished_body(stalled_gateway: Gateway) -> None:
    body = {"prompt": "def add(a, b):\n    ", "max_tokens": 16, "stream": True}
    headers = {"Authorization": f"Bearer {KEY_ACME}"}
    with stalled_gateway.client(timeout=30) as c, c.stream("POST", "/v1/completions", json=body, headers=headers) as r:
        assert r.status_code == 200  # the stream had started before the engine went quiet
        raw = b"".join(r.iter_bytes())
    events = [e[6:] for e in raw.split(b"\n\n") if e.startswith(b"data: ")]
    assert b"[DONE]" not in events, "a client must not read the partial text as a complete suggestion"
    assert orjson.loads(events[0])["choices"][0]["text"] == "return a"
    err = orjson.loads(events[-1])["error"]
    assert err["code"] == "engine_stream_interrupted" and "stopped sending" in err["message"]
