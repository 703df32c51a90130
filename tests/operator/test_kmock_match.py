"""The operator tests' fast request matching in kmock (tests/operator/kmock_match.py) answers as kmock does.

A real emulator gets real HTTP: discovery, a list, a create, a watch-less fetch, a 404, and a sliced fault reaction
(``[:2]``: history-dependent, so it keeps kmock's own answer). Then every recorded request is asked of every reaction
both ways.
"""

from __future__ import annotations

from typing import Any

import httpx
from kmock._internal import dsl

from tests.operator import kmock_match


async def test_the_fast_answer_is_kmocks_answer_for_every_reaction_and_request(kmock: Any) -> None:
    kmock_match.install()
    kmock.resources["v1/configmaps"] = kmock.ResourceInfo(kind="ConfigMap", namespaced=True, verbs={"list", "create"})
    kmock["get", "/api/v1/namespaces/ns/configmaps/faulty"][:2] << 500 << {"kind": "Status", "code": 500}
    url = str(kmock.url).rstrip("/")
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        statuses = [
            (await client.get("/api")).status_code,
            (await client.get("/api/v1")).status_code,
            (await client.get("/api/v1/namespaces/ns/configmaps")).status_code,
            (await client.post("/api/v1/namespaces/ns/configmaps", json={"metadata": {"name": "a"}})).status_code,
            (await client.get("/api/v1/namespaces/ns/configmaps/faulty")).status_code,
            (await client.get("/api/v1/namespaces/ns/configmaps/faulty")).status_code,
            (await client.get("/api/v1/namespaces/ns/configmaps/faulty")).status_code,
            (await client.get("/no/such/endpoint")).status_code,
        ]
    assert statuses[:4] == [200, 200, 200, 200] and statuses[4:6] == [500, 500], statuses
    assert statuses[6] != 500, "the slice ran out: kmock's own answer for history-dependent chains"

    requests = list(kmock)
    reactions = list(kmock._payloads)
    assert len(requests) == 8 and len(reactions) > 10
    fast_paths = 0
    for reaction in reactions:
        view = reaction._source
        for request in requests:
            fast = kmock_match.seen_through_filters(view, request)
            fast_paths += fast is not None
            assert (request in view) == kmock_match._kmocks_contains(view, request), (view, request)
    assert fast_paths >= (len(reactions) - 1) * len(requests), "all but the sliced reaction take the fast path"
    assert any(isinstance(r._source, dsl.Slicer) or "Slicer" in repr(type(r._source)) for r in reactions)
