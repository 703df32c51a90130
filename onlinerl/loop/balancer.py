"""One front port for N local serving replicas: a least-in-flight HTTP reverse proxy that streams SSE through.

Why a proxy of our own: ``onlinerl up --serving-replicas N`` must behave like a Kubernetes Service in front of N
serving pods, with no extra software to install. Each request goes to the ready replica with the fewest requests in
flight (round-robin among equals). A replica that refuses the connection is skipped and the request goes to the next
one: a refused connection means no byte reached it. A request that may have reached a replica (a write, a read or a
protocol error after connecting) is never sent again -- the gateway may already have recorded a rollout for it -- and
the client gets a 502 naming the replica (or, mid-stream, the connection is cut so a partial completion never looks
whole). Response bodies pass through chunk by chunk as the replica sends them, with ``X-OnlineRL-Replica`` naming the
replica that answered.

``/internal/*`` (the gateway's loopback-only admin routes) is never forwarded: the proxy connects from loopback, so
forwarding would hand any client the admin routes. ``/healthz`` and ``/balancer/status`` (loopback only) are the
proxy's own; everything else is forwarded unchanged.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from onlinerl.asgi import Receive, Scope, Send, read_capped, serve
from onlinerl.http_errors import error_body, error_type

log = logging.getLogger("onlinerl.balancer")

# Hop-by-hop headers (RFC 9110 7.6.1) are the proxy's own business on each side; host is the replica's.
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"host",
    }
)
REPLICA_HEADER = b"x-onlinerl-replica"  # which replica answered (to trace a request to its replica's logs)
LOOPBACK = {"127.0.0.1", "::1", "localhost"}
# Errors raised before any byte of the request left this process: safe to try the next replica.
NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)


@dataclass
class Replica:
    """One upstream gateway and what the proxy knows of it (counts are since the proxy started)."""

    name: str
    url: str
    ready: bool = True  # last probe (or connect) result; an unready replica gets traffic only when none is ready
    inflight: int = 0
    sent: int = 0  # requests answered by this replica (any status)
    refused: int = 0  # connections refused: the request went to another replica
    failed: int = 0  # requests that reached it and broke (502 or a cut stream)

    def snapshot(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "url": self.url,
            "ready": self.ready,
            "inflight": self.inflight,
            "sent": self.sent,
            "refused": self.refused,
            "failed": self.failed,
        }


def choose(replicas: Sequence[Replica], tried: set[str], turn: int) -> Replica | None:
    """The replica for the next attempt: not yet tried, ready if any such is, fewest in flight, ties by ``turn``.

    Pure, so the policy is tested without sockets. An unready replica stays a last resort: its gateway then answers
    the client itself (its 503 says why), which beats the proxy guessing."""
    left = [r for r in replicas if r.name not in tried]
    pool = [r for r in left if r.ready] or left
    if not pool:
        return None
    n = len(pool)
    return min(pool, key=lambda r: (r.inflight, (pool.index(r) - turn) % n))


def upstream_headers(scope: Scope) -> list[tuple[bytes, bytes]]:
    """The client's headers minus hop-by-hop ones (the replica's gateway reads only its own headers)."""
    return [(k, v) for k, v in scope["headers"] if k.lower() not in HOP_BY_HOP]


class Balancer:
    """The ASGI app. ``probe_interval`` paces the ``/readyz`` probes that move replicas in and out of rotation."""

    def __init__(
        self,
        upstreams: Sequence[tuple[str, str]],
        *,
        max_body: int,
        connect_timeout: float = 2.0,
        probe_interval: float = 0.5,
    ) -> None:
        if not upstreams:
            raise ValueError("a balancer needs at least one upstream")
        self.replicas = [Replica(name, url.rstrip("/")) for name, url in upstreams]
        self.max_body = max_body
        self.connect_timeout = connect_timeout
        self.probe_interval = probe_interval
        self.turns = itertools.count()
        self.client: httpx.AsyncClient | None = None
        self.prober: asyncio.Task | None = None

    # -- lifecycle -----------------------------------------------------------------------------------------------
    async def startup(self) -> None:
        # Idle connections close at 4 s, before the gateway's uvicorn drops them at 5 s: a request is never written
        # into a connection the replica is closing (that would read as "may have reached it": a 502, not a retry).
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256, keepalive_expiry=4.0)
        # No read timeout: each gateway bounds its own requests (serving.requestTimeoutSeconds, drain timeouts).
        timeout = httpx.Timeout(None, connect=self.connect_timeout)
        self.client = httpx.AsyncClient(limits=limits, timeout=timeout)
        self.prober = asyncio.create_task(self._probe_forever())

    async def shutdown(self) -> None:
        if self.prober is not None:
            self.prober.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.prober
        if self.client is not None:
            await self.client.aclose()

    async def _probe_forever(self) -> None:
        while True:
            await asyncio.gather(*(self._probe(r) for r in self.replicas))
            await asyncio.sleep(self.probe_interval)

    async def _probe(self, replica: Replica) -> None:
        try:
            resp = await self.client.get(f"{replica.url}/readyz", timeout=1.0)
            ready = resp.status_code == 200
        except httpx.HTTPError:
            ready = False
        if ready != replica.ready:
            log.warning("replica %s is %s", replica.name, "ready" if ready else "not ready")
        replica.ready = ready

    # -- ASGI ------------------------------------------------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path: str = scope["path"]
        client_host = (scope.get("client") or ("", 0))[0]
        if path == "/healthz":
            ready = sum(r.ready for r in self.replicas)
            await _json(send, 200, {"status": "ok", "replicas": len(self.replicas), "ready": ready})
        elif path == "/balancer/status":
            if client_host not in LOOPBACK:
                await _error(send, 403, "/balancer/status is served to loopback clients only")
            else:
                await _json(send, 200, {"replicas": [r.snapshot() for r in self.replicas]})
        elif path.startswith("/internal/") or path == "/internal":
            await _error(
                send, 404, f"{path} is not served on the front port: /internal routes belong to each replica's gateway"
            )
        else:
            await self._forward(scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await self.startup()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _forward(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            body = await read_capped(receive, self.max_body, _TooLarge, _Disconnected)
        except _TooLarge:
            await _error(send, 413, f"request body over {self.max_body} bytes (serving.maxPromptChars sets the cap)")
            return
        except _Disconnected:
            return
        target = scope["path"] + (("?" + scope["query_string"].decode("latin-1")) if scope["query_string"] else "")
        headers = upstream_headers(scope)
        tried: set[str] = set()
        turn = next(self.turns)
        while True:
            replica = choose(self.replicas, tried, turn)
            if replica is None:
                names = ", ".join(sorted(tried))
                await _error(send, 503, f"no serving replica accepts connections (tried {names}); retry shortly")
                return
            tried.add(replica.name)
            replica.inflight += 1
            try:
                request = self.client.build_request(
                    scope["method"], replica.url + target, headers=headers, content=body
                )
                try:
                    response = await self.client.send(request, stream=True)
                except NOT_SENT as exc:
                    replica.refused += 1
                    replica.ready = False  # out of rotation until its next good probe
                    log.warning("replica %s refused a connection (%s): trying the next one", replica.name, exc)
                    continue
                except httpx.HTTPError as exc:
                    replica.failed += 1
                    log.error("replica %s failed before answering: %r (not retried)", replica.name, exc)
                    message = f"serving replica {replica.name} failed before answering: {exc!r}"
                    await _error(send, 502, message, [(REPLICA_HEADER, replica.name.encode())])
                    return
                await self._relay(replica, response, receive, send)
                return
            finally:
                replica.inflight -= 1

    async def _relay(self, replica: Replica, response: httpx.Response, receive: Receive, send: Send) -> None:
        """Stream ``response`` to the client chunk by chunk; stop reading the replica when the client leaves."""
        try:
            headers = [(k, v) for k, v in response.headers.raw if k.lower() not in HOP_BY_HOP]
            headers.append((REPLICA_HEADER, replica.name.encode()))
            await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
            gone = asyncio.ensure_future(_wait_disconnect(receive))
            try:
                chunks = response.aiter_raw()
                while True:
                    step = asyncio.ensure_future(anext(chunks, None))
                    done, _ = await asyncio.wait({step, gone}, return_when=asyncio.FIRST_COMPLETED)
                    if step not in done:  # the client left: closing the response tells the gateway at once
                        step.cancel()
                        with contextlib.suppress(BaseException):
                            await step
                        return
                    chunk = step.result()
                    if chunk is None:
                        break
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                replica.sent += 1
            except httpx.HTTPError as exc:
                replica.failed += 1
                log.error("replica %s broke mid-response: %r (connection to the client cut)", replica.name, exc)
                raise  # the server cuts the client's connection: a partial body must not look complete
            finally:
                gone.cancel()
        finally:
            await response.aclose()


class _TooLarge(Exception):
    pass


class _Disconnected(Exception):
    pass


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _json(send: Send, status: int, payload: dict, extra: Sequence[tuple[bytes, bytes]] = ()) -> None:
    body = orjson.dumps(payload)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *extra]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _error(send: Send, status: int, message: str, extra: Sequence[tuple[bytes, bytes]] = ()) -> None:
    extra = [*extra, (b"retry-after", b"1")] if status == 503 else list(extra)
    await _json(send, status, error_body(message, type_=error_type(status)), extra)


def main(argv: list[str] | None = None) -> int:
    """``python -m onlinerl.loop.balancer --upstream NAME=URL ...``: host, port and body cap from the job config."""
    from onlinerl.config import load_config

    ap = argparse.ArgumentParser(prog="python -m onlinerl.loop.balancer", description=main.__doc__)
    ap.add_argument("--upstream", action="append", required=True, help="NAME=URL of one replica's gateway")
    args = ap.parse_args(argv)
    upstreams = [tuple(item.split("=", 1)) for item in args.upstream]
    if any(len(u) != 2 for u in upstreams):
        ap.error("--upstream: expected NAME=URL")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    cfg = load_config()
    app = Balancer(
        upstreams,
        max_body=cfg.serving.max_body_bytes,  # the gateway's own cap
        connect_timeout=cfg.serving.engine_connect_timeout_seconds,
    )
    log.info("balancing %s on %s:%d", ", ".join(f"{n}={u}" for n, u in upstreams), cfg.serving.host, cfg.serving.port)
    started = time.monotonic()
    serve(app, cfg.serving.host, cfg.serving.port)
    log.info("stopped after %.0fs", time.monotonic() - started)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
