"""Hypothesis strategies from a JSON Schema (the subset our APIs' documents use), and hostile mutations of them.

hypothesis-jsonschema is not available, so this walks the schema itself: ``$ref`` (local), ``anyOf``/``oneOf``,
``enum``/``const``, ``type`` (one or a list), object ``properties``/``required``/``maxProperties``, array
``items``/``minItems``/``maxItems``, string ``minLength``/``maxLength``, number ``minimum``/``maximum``. Sizes are
kept small on purpose: the fuzz runs against real servers in CI with a bounded budget.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import orjson
from hypothesis import strategies as st

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
MAX_TEXT = 24  # characters per generated string: enough for unicode edge cases, cheap for vLLM
# Any code point JSON can carry (no lone surrogates: orjson and every JSON parser refuse them).
CHARS = st.characters(exclude_categories=("Cs",))
TRICKY_TEXT = st.sampled_from(
    [
        "",
        "\x00",
        "\u202e\u2066",
        "😀👩‍💻",
        "é\u0301",
        "\ufeff",
        "\r\n\t",
        "<|fim_prefix|>",
        "' OR 1=1 --",
        "\\u0000",
        "𝔘",
    ]
)


def resolve(schema: dict[str, Any], root: dict[str, Any]) -> dict[str, Any]:
    """Follow a local ``$ref`` (``#/components/schemas/X``, ``#/$defs/X``)."""
    while "$ref" in schema:
        node: Any = root
        for part in schema["$ref"].removeprefix("#/").split("/"):
            node = node[part]
        schema = node
    return schema


def text(min_size: int = 0, max_size: int = MAX_TEXT) -> st.SearchStrategy[str]:
    plain = st.text(CHARS, min_size=min_size, max_size=max_size)
    tricky = TRICKY_TEXT.filter(lambda s: min_size <= len(s) <= max_size)
    return st.one_of(plain, tricky) if min_size <= max_size else st.nothing()


def from_schema(schema: dict[str, Any], root: dict[str, Any] | None = None) -> st.SearchStrategy[Any]:
    """Values valid under ``schema`` (string and array sizes capped at MAX_TEXT / 4 items)."""
    root = root or schema
    schema = resolve(schema, root)
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return st.one_of([from_schema(s, root) for s in schema[key]])
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if isinstance(kind, list):
        return st.one_of([from_schema({**schema, "type": k}, root) for k in kind])
    if kind == "null":
        return st.none()
    if kind == "boolean":
        return st.booleans()
    if kind == "integer":
        # unbounded means "any int64": past 64 bits JSON parsers disagree (orjson refuses, RFC 8259 warns)
        return st.integers(schema.get("minimum", INT64_MIN), schema.get("maximum", INT64_MAX))
    if kind == "number":
        lo, hi = schema.get("minimum"), schema.get("maximum")
        floats = st.floats(lo, hi, allow_nan=False, allow_infinity=False)
        ints = st.integers(math.ceil(lo) if lo is not None else None, math.floor(hi) if hi is not None else None)
        return st.one_of(floats, ints)
    if kind == "string":
        return text(schema.get("minLength", 0), min(schema.get("maxLength", MAX_TEXT), MAX_TEXT))
    if kind == "array":
        items = from_schema(schema.get("items", {"type": "string"}), root)
        return st.lists(items, min_size=schema.get("minItems", 0), max_size=min(schema.get("maxItems", 4), 4))
    if kind == "object" or "properties" in schema:
        if schema.get("maxProperties") == 0:
            return st.just({})
        return _object(schema, root)
    return json_values()


def _object(schema: dict[str, Any], root: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    props = schema.get("properties", {})
    required = set(schema.get("required", ()))
    optional = sorted(set(props) - required)

    @st.composite
    def build(draw: st.DrawFn) -> dict[str, Any]:
        out = {name: draw(from_schema(props[name], root)) for name in sorted(required)}
        for name in draw(st.lists(st.sampled_from(optional), unique=True)) if optional else ():
            out[name] = draw(from_schema(props[name], root))
        return out

    return build()


def json_values(max_leaves: int = 6) -> st.SearchStrategy[Any]:
    """Any JSON value, small."""
    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(1 << 63), (1 << 64) - 1),
        st.floats(allow_nan=False, allow_infinity=False),
        text(),
    )
    return st.recursive(
        scalars,
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text(0, 8), inner, max_size=3),
        max_leaves=max_leaves,
    )


# --- hostile mutations -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Mutation:
    """A body made invalid (or odd) on purpose; ``field`` is the field it touched (None: the body as a whole)."""

    kind: str
    field: str | None
    content: bytes


def _wrong_type(schema: dict[str, Any], root: dict[str, Any]) -> st.SearchStrategy[Any]:
    """A value whose JSON type the field's schema does not list."""
    allowed = _types(schema, root)
    pool = {
        "string": text(1, 8),
        "integer": st.integers(-1000, 1000),
        "number": st.floats(-1e6, 1e6, allow_nan=False).filter(lambda x: x != int(x)),
        "boolean": st.booleans(),
        "null": st.none(),
        "array": st.lists(st.integers(0, 3), min_size=1, max_size=2),
        "object": st.dictionaries(text(1, 4), st.integers(), min_size=1, max_size=2),
    }
    wrong = [s for k, s in pool.items() if k not in allowed and not (k == "integer" and "number" in allowed)]
    return st.one_of(wrong) if wrong else st.nothing()


def _types(schema: dict[str, Any], root: dict[str, Any]) -> set[str]:
    schema = resolve(schema, root)
    out: set[str] = set()
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key, ()):
            out |= _types(sub, root)
    kind = schema.get("type")
    if isinstance(kind, list):
        out |= set(kind)
    elif kind:
        out.add(kind)
    for value in schema.get("enum", ()):
        out.add(_json_type(value))
    return out


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    return {str: "string", list: "array", dict: "object"}[type(value)]


def _bounds(schema: dict[str, Any], root: dict[str, Any]) -> tuple[Any, Any, str] | None:
    """(minimum, maximum, type) of the numeric branch of a field, if it has bounds."""
    schema = resolve(schema, root)
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key, ()):
            found = _bounds(sub, root)
            if found:
                return found
    if schema.get("type") in ("integer", "number") and ("minimum" in schema or "maximum" in schema):
        return schema.get("minimum"), schema.get("maximum"), schema["type"]
    return None


def _out_of_range(lo: Any, hi: Any) -> st.SearchStrategy[Any]:
    options = []
    if hi is not None:
        options += [st.just(hi + 1), st.integers(hi + 1, hi + 10**6), st.just(1e300)]
    if lo is not None:
        options += [st.just(lo - 1), st.integers(lo - 10**6, lo - 1), st.just(-1e300)]
    return st.one_of(options).filter(lambda v: -(1 << 63) <= v < (1 << 64))


def _max_length(schema: dict[str, Any], root: dict[str, Any]) -> int | None:
    schema = resolve(schema, root)
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key, ()):
            found = _max_length(sub, root)
            if found is not None:
                return found
    return schema.get("maxLength") if schema.get("type") == "string" else None


def with_deep_field(body: dict[str, Any], key: str, depth: int) -> bytes:
    """``body`` plus ``key: [[[...0...]]]`` nested ``depth`` deep, written by hand (encoders stop at ~255 levels)."""
    head = orjson.dumps(body)[:-1] + (b"," if body else b"")
    return head + orjson.dumps(key) + b":" + b"[" * depth + b"0" + b"]" * depth + b"}"


NON_JSON = st.one_of(
    st.binary(max_size=64).filter(lambda b: _not_json(b)),
    st.sampled_from(
        [
            b"",
            b"{",
            b'{"prompt": "x"',
            b"\xff\xfe{}",
            b'{"prompt": NaN}',
            b"{'prompt': 'x'}",
            b'{"prompt": "\\ud800"}',
            b'{"prompt": "x"} trailing',
            b"\xef\xbb\xbf{}",
            b"null",
        ]
    ),
)


def _not_json(raw: bytes) -> bool:
    try:
        orjson.loads(raw)
    except orjson.JSONDecodeError:
        return True
    return False


def mutations(schema: dict[str, Any], root: dict[str, Any], huge: int) -> st.SearchStrategy[Mutation]:
    """Bodies derived from a valid one, each broken in one way; ``huge``: a string length over any cap."""
    schema = resolve(schema, root)
    props = schema.get("properties", {})
    names = sorted(props)
    required = sorted(schema.get("required", ()))
    bounded = sorted(n for n in names if _bounds(props[n], root))
    capped = sorted(n for n in names if _max_length(props[n], root) is not None)
    valid = from_schema(schema, root)

    @st.composite
    def mutate(draw: st.DrawFn) -> Mutation:
        body = draw(valid)
        kinds = ["wrong_type", "extra_field", "unicode", "non_json", "deep_nesting", "not_object"]
        kinds += ["missing_field"] * bool(required) + ["out_of_range"] * bool(bounded) + ["too_long"] * bool(capped)
        kind = draw(st.sampled_from(kinds))
        field: str | None = None
        if kind == "wrong_type":
            field = draw(st.sampled_from(names))
            body[field] = draw(_wrong_type(props[field], root))
        elif kind == "missing_field":
            field = draw(st.sampled_from(required))
            del body[field]
        elif kind == "out_of_range":
            field = draw(st.sampled_from(bounded))
            lo, hi, _ = _bounds(props[field], root)  # type: ignore[misc]
            body[field] = draw(_out_of_range(lo, hi))
        elif kind == "too_long":
            field = draw(st.sampled_from(capped))
            cap = _max_length(props[field], root) or 0
            body[field] = "x" * draw(st.sampled_from([cap + 1, min(max(cap + 1, huge), 10**6)]))
        elif kind == "extra_field":
            body[draw(text(1, 12).filter(lambda k: k not in props))] = draw(json_values())
        elif kind == "unicode":
            strings = [n for n in names if "string" in _types(props[n], root)]
            field = draw(st.sampled_from(strings))
            body[field] = draw(text(0, 16).map(lambda s: s + "\u202e😀\x00"))
        elif kind == "deep_nesting":
            key = draw(text(1, 8).filter(lambda k: k not in props))
            return Mutation(kind, None, with_deep_field(body, key, draw(st.sampled_from([64, 600, 5000]))))
        elif kind == "not_object":
            return Mutation(kind, None, dumps(draw(st.one_of(st.lists(st.integers(), max_size=3), text()))))
        else:
            return Mutation(kind, None, draw(NON_JSON))
        return Mutation(kind, field, dumps(body))

    return mutate()


def dumps(value: Any) -> bytes:
    """JSON bytes; integers past 64 bits (which orjson will not write) go through the standard library."""
    try:
        return orjson.dumps(value)
    except TypeError:
        return json.dumps(value).encode()


# --- headers -----------------------------------------------------------------------------------------------------
HEADER_NAME = st.text(st.sampled_from("abcdefghijklmnopqrstuvwxyz0123456789-_"), min_size=1, max_size=16).filter(
    lambda n: n[0].isalnum() and n.lower() not in {"host", "content-length", "transfer-encoding", "connection"}
)
# Header values are bytes on the wire: visible latin-1 (obs-text included), no CR/LF/NUL, no surrounding blanks.
HEADER_VALUE = st.binary(max_size=48).map(lambda b: bytes(c for c in b if c >= 0x20 and c != 0x7F).strip())
HEADERS = st.lists(st.tuples(HEADER_NAME.map(str.encode), HEADER_VALUE), max_size=4)
