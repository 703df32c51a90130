"""``onlinerl simulate``: simulated Continue users driving the running stack with real FIM samples.

Each user sends Continue's exact streaming request, decides with :mod:`onlinerl.loop.user_model`, and uploads the
outcome on Continue's clock: an accept right after a short think time, a reject only once the 10 s window has passed.
Uploads run in the background, so a user's next request is not held up by the previous reject window.
Every request becomes one line of a JSONL timeline (request, version, shown text, accepted, latency). A completion
Continue would not display (empty after its filters) is not uploaded, as Continue logs only what it displayed.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from onlinerl.data.builder import FimSample
from onlinerl.loop.continue_client import ContinueClient
from onlinerl.loop.user_model import AcceptRule, continue_postprocess, decide


@dataclass
class SimulateOptions:
    requests: int = 100
    concurrency: int = 4
    # distinct users (client_factory(uid) for uid < users) taking turns over the connections: each request is the
    # next user's, so every arm gets the share of users the routing gives it (a user is never in two requests at once)
    users: int = 4
    accept_delay_s: float = 0.3
    reject_window_s: float = 10.0
    seed: int = 0
    duration_s: float | None = None
    max_prefix_chars: int = 1200
    rule: AcceptRule = field(default_factory=AcceptRule)
    # a user whose suggestion failed keeps typing: the next request comes one debounce or so later, so an outage
    # (a component restarting) is a pause in that user's traffic, not a tight loop of refused requests
    fail_pause_s: float = 0.5


@dataclass
class SimulateTotals:
    requests: int = 0
    failed: int = 0
    shown: int = 0
    accepted: int = 0
    feedback_ok: int = 0
    feedback_other: int = 0
    versions: set[int] | None = None

    def line(self) -> str:
        rate = self.accepted / self.shown if self.shown else 0.0
        return (
            f"{self.requests} requests, {self.failed} failed, {self.shown} shown, {self.accepted} accepted "
            f"(accept rate {rate:.3f}), versions seen {sorted(self.versions or [])}"
        )


class Progress:
    """A one-line progress bar on stderr (no dependency), redrawn at most 10 times a second."""

    def __init__(self, total: int, enabled: bool = True) -> None:
        self.total, self.enabled, self._last = total, enabled and sys.stderr.isatty(), 0.0

    def update(self, totals: SimulateTotals, force: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (not force and now - self._last < 0.1):
            return
        self._last = now
        width = 30
        done = min(totals.requests, self.total)
        rate = totals.accepted / totals.shown if totals.shown else 0.0
        if self.total == sys.maxsize:  # no request limit (--duration ends the run): a count, not a bar
            head = f"{done} requests"
        else:
            head = f"[{'#' * int(width * done / max(1, self.total)):<{width}}] {done}/{self.total}"
        sys.stderr.write(f"\r{head} accept={rate:.2f} v={max(totals.versions or {0})} failed={totals.failed}  ")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


async def simulate(
    samples: list[FimSample],
    client_factory: Callable[[int], ContinueClient],
    opts: SimulateOptions,
    timeline_path: Path | None = None,
    progress: bool = True,
    stop: asyncio.Event | None = None,
) -> SimulateTotals:
    """Run ``opts.requests`` requests (or until ``duration_s``, or until ``stop`` is set) over ``opts.concurrency``
    users. Stopping starts no new request; those in flight and their uploads finish, so the totals stay exact."""
    rng = random.Random(opts.seed)
    order = list(range(len(samples)))
    rng.shuffle(order)
    totals = SimulateTotals(versions=set())
    bar = Progress(opts.requests, progress)
    timeline = open(timeline_path, "ab") if timeline_path else None  # noqa: SIM115 - closed in finally
    start = time.monotonic()
    next_index = 0
    uploads: set[asyncio.Task] = set()
    lock = asyncio.Lock()

    async def upload(client: ContinueClient, http: httpx.AsyncClient, body: dict, delay: float, entry: dict) -> None:
        await asyncio.sleep(delay)
        up = await client.upload(http, body)
        status, reply = up.status, up.reply
        entry["feedback_status"] = status
        entry["feedback_attempts"] = up.attempts
        entry["feedback"] = reply.get("status") if isinstance(reply, dict) else None
        if isinstance(reply, dict):  # the stream entry a 200 promised to keep: bench/chaos_kill.py checks the ledger
            entry["feedback_ids"] = [reply[k] for k in ("sample_id", "audit_id", "entry_id") if reply.get(k)]
        if status == 200:
            totals.feedback_ok += 1
        else:
            totals.feedback_other += 1
        if timeline:
            timeline.write(orjson.dumps(entry) + b"\n")
            timeline.flush()

    clients = [client_factory(uid) for uid in range(max(opts.users, opts.concurrency))]
    idle = list(range(len(clients)))  # users not in a request now, in turn order

    async def user(worker: int, http: httpx.AsyncClient) -> None:
        nonlocal next_index
        while True:
            async with lock:
                if next_index >= opts.requests or (opts.duration_s and time.monotonic() - start > opts.duration_s):
                    return
                if stop is not None and stop.is_set():
                    return
                sample = samples[order[next_index % len(order)]]
                next_index += 1
                uid = idle.pop(0)
            client = clients[uid]
            try:
                await one_request(uid, client, sample, http)
            finally:
                idle.append(uid)

    async def one_request(uid: int, client: ContinueClient, sample: Any, http: httpx.AsyncClient) -> None:
        prefix = sample.prefix[-opts.max_prefix_chars :]
        prompt = client.template.render(prefix, sample.suffix)
        res = await client.complete(http, prompt)
        totals.requests += 1
        entry = {
            "t": round(time.time(), 3),
            "user": uid,
            "sample_id": sample.id,
            "kind": sample.kind,
            "version": res.version,
            "arm": res.arm,
            "status": res.status,
            "error": res.error or None,
            "latency_ms": round(res.latency_ms, 1),
            "ttft_ms": None if res.ttft_ms is None else round(res.ttft_ms, 1),
        }
        if res.failed:
            totals.failed += 1
            if timeline:
                timeline.write(orjson.dumps(entry) + b"\n")
            bar.update(totals)
            await asyncio.sleep(opts.fail_pause_s)
            return
        if res.version is not None:
            totals.versions.add(res.version)
        shown = continue_postprocess(res.text, prefix, sample.suffix)
        accepted = decide(shown, sample.middle, opts.rule)
        totals.shown += bool(shown)
        totals.accepted += accepted
        entry.update(
            raw=res.text,
            shown=shown,
            accepted=accepted,
            middle_first_line=sample.middle.strip().split("\n")[0][:120],
        )
        if not shown:  # Continue displays nothing, so it logs nothing: no feedback for this rollout
            if timeline:
                timeline.write(orjson.dumps(entry) + b"\n")
            bar.update(totals)
            return
        body = client.outcome(
            prompt=prompt,
            prefix=prefix,
            suffix=sample.suffix,
            filepath=sample.file,
            shown=shown,
            accepted=accepted,
            latency_ms=res.latency_ms,
        )
        delay = opts.accept_delay_s if accepted else opts.reject_window_s
        task = asyncio.create_task(upload(client, http, body, delay, entry))
        uploads.add(task)
        task.add_done_callback(uploads.discard)
        bar.update(totals)

    limits = httpx.Limits(max_connections=opts.concurrency * 4, max_keepalive_connections=opts.concurrency * 2)
    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=5.0), limits=limits) as http:
            await asyncio.gather(*(user(i, http) for i in range(opts.concurrency)))
            if uploads:
                await asyncio.gather(*list(uploads))
    finally:
        bar.update(totals, force=True)
        bar.close()
        if timeline:
            timeline.close()
    return totals
