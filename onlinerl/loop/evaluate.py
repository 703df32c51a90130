"""``onlinerl eval``: offline evaluation of policy versions through the same serving path users hit.

Each version is requested explicitly (header ``X-OnlineRL-Version``), with Continue's exact request, over the same
held-out samples, so the versions differ only in weights. Figures come from :mod:`onlinerl.loop.eval_metrics`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from onlinerl.data.builder import FimSample
from onlinerl.loop.continue_client import ContinueClient
from onlinerl.loop.eval_metrics import EvalRecord
from onlinerl.loop.user_model import continue_postprocess


@dataclass
class VersionRun:
    version: int
    records: list[EvalRecord]
    served_versions: set[int]


async def run_version(
    samples: list[FimSample],
    client_factory: Callable[[int], ContinueClient],
    version: int,
    concurrency: int = 4,
    on_done: Callable[[], None] | None = None,
    max_prefix_chars: int = 1200,
) -> VersionRun:
    """Complete every sample with ``version`` pinned; a request served by another version counts as failed."""
    queue: asyncio.Queue[FimSample] = asyncio.Queue()
    for s in samples:
        queue.put_nowait(s)
    records: list[EvalRecord] = []
    served: set[int] = set()

    async def worker(uid: int, http: httpx.AsyncClient) -> None:
        client = client_factory(uid)
        while not queue.empty():
            s = queue.get_nowait()
            prefix = s.prefix[-max_prefix_chars:]
            res = await client.complete(http, client.template.render(prefix, s.suffix), pin_version=version)
            if res.version is not None:
                served.add(res.version)
            # served by another version, or (issue 39) by the same number of another policy line
            wrong = (res.version is not None and res.version != version) or (
                res.line is not None and res.line != client.pin_line
            )
            records.append(
                EvalRecord(
                    s.id,
                    s.middle,
                    continue_postprocess(res.text, prefix, s.suffix),
                    failed=res.failed or wrong,
                    version=version,
                    raw=res.text,
                )
            )
            if on_done:
                on_done()

    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=5.0)) as http:
        await asyncio.gather(*(worker(i, http) for i in range(concurrency)))
    records.sort(key=lambda r: r.sample_id)
    return VersionRun(version, records, served)
