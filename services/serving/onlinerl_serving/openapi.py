"""The gateway's OpenAPI 3.1 document (``GET /openapi.json``), written by hand from what requests.py accepts.

The completions route is raw ASGI (no framework to generate a schema), so the document is built here from the same
constants and the same configured caps that :func:`onlinerl_serving.requests.parse_completion_request` enforces: a
body valid under this schema is one the gateway serves, anything else gets a 400 naming the field. Clients and the
property-based fuzz (tests/fuzz/) read it; keep the two in step when a field's rule changes.
"""

from __future__ import annotations

from typing import Any

from onlinerl_serving.requests import (
    _ALSO_NEUTRAL,
    MAX_LOGPROBS,
    MAX_STOP_SEQUENCES,
    MAX_TEMPERATURE,
    NEUTRAL_SAMPLING,
    SEED_MAX,
    SEED_MIN,
    Limits,
)


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


def completion_request_schema(limits: Limits) -> dict[str, Any]:
    """JSON Schema of a ``POST /v1/completions`` body under these caps (unknown fields are accepted and ignored)."""
    prompt = {"type": "string", "minLength": 1, "maxLength": limits.max_prompt_chars}
    stop_entry = {"type": "string", "minLength": 1}
    neutral = {
        name: _nullable({"type": "number", "enum": [value, *_ALSO_NEUTRAL.get(name, ())]})
        for name, value in NEUTRAL_SAMPLING.items()
    }
    return {
        "type": "object",
        "required": ["prompt"],
        "additionalProperties": True,
        "properties": {
            "model": {
                "type": "string",
                "description": "ignored: the gateway routes the key to a policy version of its project's line",
            },
            "prompt": {
                "description": "one raw (FIM-rendered) prompt; a list holding exactly one string is accepted",
                "anyOf": [prompt, {"type": "array", "items": prompt, "minItems": 1, "maxItems": 1}],
            },
            "max_tokens": _nullable(
                {
                    "type": "integer",
                    "minimum": 1,
                    "maximum": limits.max_tokens_cap,
                    "default": min(limits.default_max_tokens, limits.max_tokens_cap),
                    "description": "absent or null: serving.defaultMaxTokens (16, as OpenAI's legacy completions)",
                }
            ),
            "stream": {"type": "boolean"},
            "stream_options": _nullable(
                {"type": "object", "properties": {"include_usage": {"type": "boolean"}}, "additionalProperties": True}
            ),
            "stop": _nullable(
                {"anyOf": [stop_entry, {"type": "array", "items": stop_entry, "maxItems": MAX_STOP_SEQUENCES}]}
            ),
            "temperature": _nullable({"type": "number", "minimum": 0, "maximum": MAX_TEMPERATURE}),
            "seed": _nullable({"type": "integer", "minimum": SEED_MIN, "maximum": SEED_MAX}),
            **neutral,
            "logit_bias": _nullable({"type": "object", "maxProperties": 0}),
            "n": {"enum": [1, None]},
            "best_of": {"enum": [1, None]},
            "echo": {"enum": [False, None]},
            "suffix": {"enum": ["", None], "description": "not supported: render the FIM prompt into `prompt`"},
            "logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS}),
            "return_token_ids": {"type": "boolean"},
            "user": _nullable({"type": "string"}),
        },
    }


ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string", "description": "what is wrong and what to fix, naming the field"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}


def _errors(*codes: int) -> dict[str, Any]:
    ref = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    return {str(c): {"description": "OpenAI error body", **ref} for c in codes}


def openapi_document(limits: Limits, served_name: str) -> dict[str, Any]:
    """The whole document: the two public routes, their auth, bodies and error shape."""
    security = [{"bearer": []}, {"apiKey": []}]
    return {
        "openapi": "3.1.0",
        "info": {"title": "onlinerl gateway", "version": "1", "description": "OpenAI completions for code completion"},
        "paths": {
            "/v1/completions": {
                "post": {
                    "operationId": "createCompletion",
                    "security": security,
                    "parameters": [
                        {
                            "name": "X-OnlineRL-Version",
                            "in": "header",
                            "required": False,
                            "description": "pin a policy version (keys with role eval or admin only)",
                            "schema": {"type": "string", "pattern": "^[0-9]{1,18}$"},
                        },
                        {
                            "name": "X-OnlineRL-Line",
                            "in": "header",
                            "required": False,
                            "description": "with X-OnlineRL-Version: the version is of the key's own project's policy "
                            "line (per-project adapters); absent: the shared policy's. Another project: 403",
                            "schema": {"type": "string"},
                        },
                        {
                            "name": "X-Project-ID",
                            "in": "header",
                            "required": False,
                            "description": "optional: the key's own project (a key is always served its own "
                            "project's policy); another project: 403 wrong_project",
                            "schema": {"type": "string"},
                        },
                    ],
                    "requestBody": {
                        "required": True,
                        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/CompletionRequest"}}},
                    },
                    "responses": {
                        "200": {
                            "description": "the completion (JSON, or an SSE stream when `stream` is true)",
                            "content": {"application/json": {"schema": {"type": "object"}}, "text/event-stream": {}},
                        },
                        **_errors(400, 401, 403, 409, 413, 503, 504),
                    },
                }
            },
            "/v1/models": {
                "get": {
                    "operationId": "listModels",
                    "security": security,
                    "responses": {
                        "200": {
                            "description": "the served model",
                            "content": {
                                "application/json": {
                                    "schema": {
                                        "type": "object",
                                        "properties": {"data": {"type": "array", "items": {"type": "object"}}},
                                    },
                                    "example": {"object": "list", "data": [{"id": served_name, "object": "model"}]},
                                }
                            },
                        },
                        **_errors(401),
                    },
                }
            },
        },
        "components": {
            "schemas": {"CompletionRequest": completion_request_schema(limits), "Error": ERROR_SCHEMA},
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "apiKey": {"type": "apiKey", "in": "header", "name": "api-key"},
            },
        },
    }


__all__ = ["ERROR_SCHEMA", "completion_request_schema", "openapi_document"]
