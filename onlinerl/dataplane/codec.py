"""Bytes to str, written once: every reader of the data plane decodes through here.

redis-py answers with bytes (no ``decode_responses``: sample entries and records are parsed straight from bytes), and
our pipelined connection answers HGETALL as a dict under RESP3 and a flat list under RESP2. Readers turn either into
``str``-keyed dicts here, so no caller compares ``b"data"`` with ``"data"``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import orjson

DATA = "data"
"""The one field of every JSON-carrying stream entry (samples, audit, decisions): ``XADD <stream> * data <json>``."""


def text(value: Any) -> str:
    """A reply value as str (bytes are UTF-8)."""
    return value.decode() if isinstance(value, bytes | bytearray) else str(value)


def pairs(raw: Mapping[Any, Any] | list | None) -> Iterable[tuple[Any, Any]]:
    """(field, value) pairs of a hash reply: a dict (redis-py, RESP3) or a flat list (RESP2), values as sent."""
    if raw is None:
        return ()
    if isinstance(raw, Mapping):
        return raw.items()
    return zip(raw[0::2], raw[1::2], strict=True)


def str_map(raw: Mapping[Any, Any] | list | None) -> dict[str, str]:
    """A hash reply as ``{str: str}``."""
    return {text(k): text(v) for k, v in pairs(raw)}


def entries(raw: Iterable[Any] | None) -> list[tuple[str, dict[str, Any]]]:
    """Stream entries ``[(id, {field: value})]`` with str ids and str field names (values left as sent: a JSON
    value is parsed from bytes directly). An entry deleted while pending (fields None) is dropped."""
    out: list[tuple[str, dict[str, Any]]] = []
    for entry_id, fields in raw or ():
        if fields is None:
            continue
        out.append((text(entry_id), {text(k): v for k, v in pairs(fields)}))
    return out


def matching_entries(client: Any, stream: str, wanted: Callable[[dict], bool], page: int = 1000) -> list[str]:
    """Ids of the stream's entries whose ``data`` JSON object satisfies ``wanted``, oldest first, read in pages of
    ``page`` (an admin's scan: `onlinerl forget`). Undecodable entries never match."""
    out: list[str] = []
    start = "-"
    while True:
        batch = entries(client.xrange(stream, min=start, count=page))
        for entry_id, fields in batch:
            try:
                obj = orjson.loads(fields.get(DATA, b"") or b"null")
            except orjson.JSONDecodeError:
                continue
            if isinstance(obj, dict) and wanted(obj):
                out.append(entry_id)
        if len(batch) < page:
            return out
        start = "(" + batch[-1][0]
