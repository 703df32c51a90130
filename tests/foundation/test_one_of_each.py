"""One of each (issue 14): the fixed ports, the body-size cap and the OpenAI-style error body are defined once in
``onlinerl/`` and every HTTP stack uses that definition. Checked on the source, and the shared pieces on behaviour."""

from __future__ import annotations

import ast
import asyncio
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from onlinerl import ports
from onlinerl.asgi import read_capped
from onlinerl.config import OnlineRLConfig
from onlinerl.http_errors import error_body, error_type

ROOT = Path(__file__).resolve().parents[2]
PORTS_MODULE = ROOT / "onlinerl" / "ports.py"
ERRORS_MODULE = ROOT / "onlinerl" / "http_errors.py"
FIXED_PORTS = {ports.GATEWAY, ports.ENGINE, ports.FEEDBACK, ports.TRAINER_METRICS, ports.RELOADER, ports.ROLLOUT}


def source_files() -> Iterator[Path]:
    """Every .py file we ship or run (tests, the venv and hidden folders excluded)."""
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).parts
        if rel[0] in {"tests", ".venv", "node_modules"} or any(p.startswith(".") for p in rel):
            continue
        yield path


def test_ports_8004_8005_appear_only_in_the_ports_module() -> None:
    """The ports of processes outside the job config: not even in a docstring, where they would go stale."""
    pattern = re.compile(r"(?<!\d)800[45](?!\d)")
    found = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in source_files()
        if path != PORTS_MODULE
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not found, f"use onlinerl.ports instead of a literal port: {found}"


def test_no_fixed_port_is_a_number_in_code_outside_the_ports_module() -> None:
    """Gateway/engine/feedback/trainer ports may be named in prose, but shipped code takes them from onlinerl.ports.

    Only the shipped packages: bench/ and tools/ use numbers like 8000 for other things (rollouts per second)."""
    shipped = ("onlinerl", "services", "operator")
    found = []
    for path in source_files():
        if path == PORTS_MODULE or path.relative_to(ROOT).parts[0] not in shipped:
            continue
        for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
            if tok.type == tokenize.NUMBER and tok.string.isdigit() and int(tok.string) in FIXED_PORTS:
                found.append(f"{path.relative_to(ROOT)}:{tok.start[0]}")
    assert not found, f"use onlinerl.ports instead of a literal port: {found}"


def test_config_defaults_and_operator_constants_are_the_ports_module() -> None:
    from onlinerl_operator import constants as c

    cfg = OnlineRLConfig()
    assert (cfg.serving.port, cfg.feedback.port, cfg.trainer.metrics_port) == (8000, 8002, 8003)
    assert cfg.serving.engine_url == "http://127.0.0.1:8001"
    assert (c.GATEWAY_PORT, c.ENGINE_PORT, c.FEEDBACK_PORT) == (ports.GATEWAY, ports.ENGINE, ports.FEEDBACK)
    assert (c.TRAINER_METRICS_PORT, c.RELOADER_PORT, c.ROLLOUT_PORT) == (8003, 8004, 8005)
    assert len(FIXED_PORTS) == 6  # no two components share a port (they share the serving pod's network)


def test_no_service_builds_its_own_error_body() -> None:
    """A dict literal ``{"error": {"message": ...}}`` anywhere but onlinerl/http_errors.py is a second renderer."""
    found = []
    for path in source_files():
        if path == ERRORS_MODULE:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Dict):
                continue
            for key, value in zip(node.keys, node.values, strict=True):
                inner = value.keys if isinstance(value, ast.Dict) else []
                if (
                    isinstance(key, ast.Constant)
                    and key.value == "error"
                    and any(isinstance(k, ast.Constant) and k.value == "message" for k in inner)
                ):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, f"render error bodies with onlinerl.http_errors: {found}"


# The files that may read ``more_body``, and why: the one request-body reader, and a reader of responses.
MORE_BODY_ALLOWED = {
    ROOT / "onlinerl" / "asgi.py": "it is read_capped",
    ROOT / "services" / "serving" / "onlinerl_serving" / "inprocess.py": "reads vLLM's response (the app's send)",
    ROOT / "bench" / "gateway_cpu.py": "plays the server: reads the gateway's response (the app's send)",
    ROOT / "bench" / "route_cost.py": "times vLLM's response: sees its last body message (the app's send)",
}


def test_no_service_reads_a_request_body_loop_of_its_own() -> None:
    """Body capping lives in onlinerl.asgi.read_capped; a second ``more_body`` loop would be a second cap."""
    found = [
        str(path.relative_to(ROOT))
        for path in source_files()
        if path not in MORE_BODY_ALLOWED and re.search(r"""\.get\(["']more_body["']""", path.read_text())
    ]
    assert not found, f"read request bodies with onlinerl.asgi.read_capped: {found}"


def test_error_body_has_the_openai_shape_in_order() -> None:
    body = error_body("field 'prompt': required", param="prompt", code="invalid_value")
    assert orjson.dumps(body) == (
        b'{"error":{"message":"field \'prompt\': required","type":"invalid_request_error",'
        b'"param":"prompt","code":"invalid_value"}}'
    )
    assert [error_type(s) for s in (400, 401, 403, 413, 422, 429, 503, 418)] == [
        "invalid_request_error",
        "authentication_error",
        "permission_error",
        "invalid_request_error",
        "invalid_request_error",
        "rate_limit_error",
        "service_unavailable",
        "invalid_request_error",
    ]


def test_gateway_api_error_renders_through_the_shared_body() -> None:
    from onlinerl_serving.errors import pin_forbidden, unauthorized

    for err in (unauthorized(), pin_forbidden("user")):
        assert err.body() == orjson.dumps(error_body(err.message, type_=err.type, param=err.param, code=err.code))
    assert orjson.loads(pin_forbidden("user").body())["error"]["param"] == "X-OnlineRL-Version"


class TooLarge(Exception):
    pass


class Gone(Exception):
    pass


def _receive(*messages: dict) -> tuple:
    """An ASGI receive that replays ``messages`` and counts how many were read."""
    queue = list(messages)
    read = [0]

    async def receive() -> dict:
        read[0] += 1
        return queue.pop(0)

    return receive, read


def _read(receive, cap: int) -> bytes:
    return asyncio.run(read_capped(receive, cap, TooLarge, Gone))


def chunk(body: bytes, more: bool = True) -> dict:
    return {"type": "http.request", "body": body, "more_body": more}


def test_read_capped_joins_chunks_up_to_the_cap() -> None:
    receive, _ = _receive(chunk(b"ab"), chunk(b"cd"), chunk(b"e", more=False))
    assert _read(receive, 5) == b"abcde"  # exactly at the cap is allowed
    receive, _ = _receive({"type": "http.request", "body": b"xyz"})  # no more_body key: the last message
    assert _read(receive, 3) == b"xyz"


def test_read_capped_refuses_a_chunked_body_over_the_cap_without_reading_the_rest() -> None:
    """Hostile: a chunked upload (no Content-Length) that keeps going; we stop at the first byte over the cap."""
    receive, read = _receive(chunk(b"a" * 4), chunk(b"b" * 4), chunk(b"c" * 4), chunk(b"", more=False))
    with pytest.raises(TooLarge):
        _read(receive, 7)
    assert read[0] == 2


def test_read_capped_reports_a_client_that_leaves_mid_body() -> None:
    receive, _ = _receive(chunk(b"{"), {"type": "http.disconnect"})
    with pytest.raises(Gone):
        _read(receive, 100)
