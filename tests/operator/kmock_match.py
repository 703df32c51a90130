"""kmock 0.8 matches each request to a reaction in time proportional to every request it has seen: this makes it
constant for the chains the emulator itself registers.

Why: to serve a request, kmock asks each reaction's view ``request in view`` (``RawHandler._handle``), and a view
answers by filtering its whole request history until it meets that request, which is the newest. With kopf's watches,
patches and events that is hundreds of requests per test and a dozen reactions per request: quadratic. kmock's own
matching was 60 % of the operator tests' CPU (cProfile of tests/operator/test_reconcile_steps.py, 2026-12-06: 32 of
the run's 60 s, in ``filtering._check``), and the operator tests are a fifth of the CPU that bounds ``make test``.

The answer for a chain of plain filters and priorities is the same without the history: the request arrived at the
root, and every filter's criteria accept it. Any other node on the chain (a slice such as ``[:1]``, a group, an
exclusion, a reaction) depends on what came before, and keeps kmock's own answer; so does anything that is not a
request. ``test_kmock_match.py`` checks both answers agree on the emulator's reactions and on a sliced one.

Faster answers moved the operator's passes closer together, and two tests then missed a status message that lived
for one observe interval: the operator dropped the problems its apply pass found at its next observe pass (fixed in
``Reconciler.observe_spec_problems``; the test that shows it is in test_redis_auth_operator.py).
"""

from __future__ import annotations

from typing import Any

from kmock._internal import dsl, rendering

_kmocks_contains = dsl.View.__contains__


def seen_through_filters(view: dsl.View, request: rendering.Request) -> bool | None:
    """``request in view`` for a chain of filters and priorities down to its root; None for any other chain."""
    node: Any = view
    while True:
        kind = type(node)
        if kind is dsl.Filter:
            if not node.criteria(request):
                return False
        elif kind is not dsl.Priority:
            if isinstance(node, dsl.Root):
                return any(seen is request for seen in reversed(node._requests))
            return None
        node = node._source


def _contains(self: dsl.View, item: Any) -> bool:
    if isinstance(item, rendering.Request):
        seen = seen_through_filters(self, item)
        if seen is not None:
            return seen
    return _kmocks_contains(self, item)


def install() -> None:
    """Answer ``request in view`` through :func:`seen_through_filters` where it applies (idempotent)."""
    dsl.View.__contains__ = _contains  # type: ignore[method-assign]
