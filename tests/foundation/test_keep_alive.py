"""Idle keep-alive connections are the client's to close: a server that drops them at the client's own idle expiry
(uvicorn's 5 s = httpx's 5 s) races a client reusing one, and the client's POST fails with "server disconnected
without sending a response" (CI: tests/loop/test_kill9.py, a request 5 s after a gateway restart).

Real processes: ``onlinerl.asgi.serve`` (the gateway's, the reloader's and the balancer's front end) and the feedback
service's own uvicorn settings, each over a raw socket held idle past the 5 s mark."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
from pathlib import Path

from onlinerl.asgi import KEEP_ALIVE_SECONDS
from onlinerl.procs import wait_for
from onlinerl.valkey import EmbeddedValkey, free_port
from tests.feedback.conftest import start_feedback

APP = """
import sys
from onlinerl.asgi import serve

async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})

serve(app, "127.0.0.1", int(sys.argv[1]), lifespan="off")
"""


def _answer(sock: socket.socket) -> bytes:
    """One response (headers and its Content-Length body), or what came before the server closed."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            return data
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))  # type: ignore[union-attr]
    while len(body) < length:
        chunk = sock.recv(4096)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


def _connects(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


def test_an_idle_connection_outlives_the_clients_expiry(tmp_path: Path) -> None:
    assert KEEP_ALIVE_SECONDS >= 60  # above httpx (5 s), undici (4 s) and proxies' upstream idle timeouts (60 s)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", APP, str(port)], stderr=subprocess.PIPE)
    try:
        wait_for(lambda: _connects(port), 30, 0.05, "the server to listen")
        first, second = _idle_then_reuse(port)
        assert first.startswith(b"HTTP/1.1 200")
        assert second.startswith(b"HTTP/1.1 200"), f"the server dropped an idle connection after 6 s: {second!r}"
    finally:
        proc.terminate()
        proc.wait(10)


def _idle_then_reuse(port: int, path: str = "/") -> tuple[bytes, bytes]:
    """Two requests on one connection, 6 s apart (past uvicorn's default 5 s keep-alive, on purpose)."""
    request = f"GET {path} HTTP/1.1\r\nHost: t\r\n\r\n".encode()
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(request)
        first = _answer(sock)
        time.sleep(6.0)
        sock.sendall(request)
        return first, _answer(sock)


def test_feedback_service_keeps_idle_connections_as_long(tmp_path: Path, empty_valkey: EmbeddedValkey) -> None:
    srv = start_feedback(tmp_path, empty_valkey.url)
    try:
        first, second = _idle_then_reuse(int(srv.url.rsplit(":", 1)[1]), "/healthz")
    finally:
        srv.stop()
    assert first.startswith(b"HTTP/1.1 200")
    assert second.startswith(b"HTTP/1.1 200"), f"the feedback service dropped an idle connection: {second!r}"
