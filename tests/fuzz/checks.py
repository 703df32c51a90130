"""The properties every fuzzed answer must have, shared by the gateway and the feedback fuzz."""

from __future__ import annotations

from typing import Any

import httpx
import orjson

ERROR_FIELDS = {"message", "type", "param", "code"}


def error_of(resp: httpx.Response) -> dict[str, Any]:
    """A 4xx's ``error`` object, checked for the OpenAI shape: all four fields, a non-empty message."""
    assert 400 <= resp.status_code < 500, (resp.status_code, resp.text[:500])
    assert resp.headers["content-type"].startswith("application/json"), resp.headers
    err = orjson.loads(resp.content)["error"]
    assert set(err) == ERROR_FIELDS, err
    assert isinstance(err["message"], str) and err["message"].strip(), err
    assert isinstance(err["type"], str), err
    assert err["param"] is None or isinstance(err["param"], str), err
    return err


def assert_names(err: dict[str, Any], *needles: str) -> None:
    """The error names the problem: ``param`` is one of ``needles`` or the message quotes one of them."""
    assert err["param"] in needles or any(n in err["message"] for n in needles), (needles, err)


def assert_not_5xx(resp: httpx.Response) -> None:
    assert resp.status_code < 500, (resp.status_code, resp.text[:500])
