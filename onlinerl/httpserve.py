"""``/metrics`` and ``/healthz`` on a background thread, for processes without a web framework (trainer, rollout).

Standard library only: a scrape must work even while the main thread is busy in a long training step.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST

Health = Callable[[], tuple[bool, str]]


def always_healthy() -> tuple[bool, str]:
    return True, "ok"


class MetricsHTTPServer:
    """Serves ``render()`` at ``/metrics`` and ``health()`` at ``/healthz`` (200 or 503 with the reason)."""

    def __init__(
        self, render: Callable[[], bytes], host: str, port: int, health: Health = always_healthy, name: str = "metrics"
    ) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?")[0]
                if path == "/metrics":
                    body, ctype, code = render(), CONTENT_TYPE_LATEST, 200
                elif path == "/healthz":
                    ok, reason = health()
                    body, ctype, code = reason.encode(), "text/plain", 200 if ok else 503
                else:
                    body, ctype, code = b"not found: use /metrics or /healthz", "text/plain", 404
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:  # scrapes are not worth a log line
                pass

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, name=name, daemon=True)

    @property
    def port(self) -> int:
        return self.server.server_address[1]

    def start(self) -> MetricsHTTPServer:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
