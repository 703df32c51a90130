"""The feedback service's OpenAPI 3.1 document (``GET /openapi.json``).

The submit route is raw ASGI in front of FastAPI (app.py), so FastAPI cannot generate its schema. The body schema is
the one pydantic derives from :class:`onlinerl.schemas.CompletionOutcome`, the model the route validates with, so the
two cannot drift; the caps (``feedback.maxBodyBytes``) and the reply shapes are stated here from the same config.
Clients and the property-based fuzz (tests/fuzz/) read it.
"""

from __future__ import annotations

from typing import Any

from onlinerl.schemas import CompletionOutcome

from .decide import ACCEPTED, CONTRIBUTION_LIMIT, DUPLICATE, REJECTED, UNMATCHED

SUBMIT_PATH = "/api/training/submit"
DATA_PATH = "/api/training/data"  # stock Continue's `data:` destination (envelope.py)

# every refusal the route can send, by HTTP code: (reason codes, what the client should do)
REFUSALS: dict[int, tuple[tuple[str, ...], str]] = {
    400: (("client_disconnected",), "the connection closed before the body was complete: send it again"),
    401: (("unauthorized",), "missing or unknown API key: send `Authorization: Bearer <key>`"),
    403: (("wrong_project",), "X-Project-ID, when sent, must name the project of the API key"),
    413: (("body_too_large",), "the body exceeds feedback.maxBodyBytes"),
    422: (
        ("invalid_json", "invalid_body", "invalid_field"),
        "the body is not a JSON AutocompleteOutcome; `error.param` names the field at fault",
    ),
    429: (("backlog_full",), "the training backlog is full: retry after the Retry-After header"),
    503: (("redis_unavailable",), "nothing was recorded: retry after the Retry-After header"),
}

REFUSAL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["status", "reason", "error"],
    "properties": {
        "status": {"const": REJECTED},
        "reason": {"type": "string", "description": "machine-readable reason; equals `error.code`"},
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string", "description": "what is wrong and what to fix, naming the field"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"], "description": "the body field or header at fault"},
                "code": {"type": "string"},
            },
        },
    },
}

RECEIPT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["status", "completion_id", "tenant"],
    "description": "Sent only after Redis acknowledged the append: the named stream entry is kept.",
    "properties": {
        "status": {"enum": [ACCEPTED, UNMATCHED, DUPLICATE, REJECTED, "audited", "quarantined"]},
        "completion_id": {"type": "string"},
        "tenant": {"type": "string"},
        "sample_id": {"type": "string", "description": "the samples-stream entry (trained on)"},
        "audit_id": {"type": "string", "description": "the audit-stream entry (kept, not trained on)"},
        "entry_id": {"type": "string", "description": "duplicate: the entry of the delivery that counted"},
        "first_outcome": {"type": "string", "description": "duplicate: the status of the delivery that counted"},
        "rollout_id": {"type": "string"},
        "reason": {"type": "string", "description": f"why, when not trained (e.g. {CONTRIBUTION_LIMIT})"},
    },
    "additionalProperties": True,
}


def outcome_schema() -> dict[str, Any]:
    """JSON Schema of the body (Continue's AutocompleteOutcome), exactly what the route validates."""
    schema = CompletionOutcome.model_json_schema(by_alias=True)
    schema["additionalProperties"] = True  # unknown fields are tolerated and ignored
    return schema


ENVELOPE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["name", "data"],
    "description": "Continue's DataLogger upload (core/data/log.ts): the event parsed with devDataVersionedSchemas"
    "[schema][level][name] of @continuedev/config-yaml. Only `autocomplete` at level `all` in a known schema is "
    "trained (`data` is then the Outcome); other events are counted and ignored, `noCode` and unknown schemas are "
    "audited.",
    "properties": {
        "name": {"type": "string", "minLength": 1, "description": "autocomplete, tokensGenerated, chatFeedback, ..."},
        "data": {"type": "object"},
        "schema": {"type": "string", "description": "0.1.0 or 0.2.0 (others: audited, answered 200)"},
        "level": {"enum": ["all", "noCode"]},
        "profileId": {"type": "string"},
    },
    "additionalProperties": True,
}

ENVELOPE_RECEIPT_SCHEMA: dict[str, Any] = {
    "oneOf": [
        {"$ref": "#/components/schemas/Receipt"},
        {
            "type": "object",
            "required": ["status", "name", "tenant"],
            "properties": {"status": {"const": "ignored"}, "name": {"type": "string"}, "tenant": {"type": "string"}},
            "description": "an event that is not an autocomplete outcome: counted by name, nothing written",
        },
        {
            "type": "object",
            "required": ["status", "reason", "tenant", "audit_id"],
            "properties": {
                "status": {"const": REJECTED},
                "reason": {"enum": ["no_code", "unknown_schema"]},
                "tenant": {"type": "string"},
                "audit_id": {"type": "string"},
                "name": {"type": "string"},
                "completion_id": {"type": "string"},
            },
            "description": "kept in the audit stream, never trained: level noCode, or a schema version we do not know",
        },
    ]
}


def _refusal(code: int) -> dict[str, Any]:
    reasons, what = REFUSALS[code]
    schema = {"allOf": [{"$ref": "#/components/schemas/Refusal"}, {"properties": {"reason": {"enum": list(reasons)}}}]}
    out: dict[str, Any] = {"description": what, "content": {"application/json": {"schema": schema}}}
    if code in (429, 503):
        out["headers"] = {"Retry-After": {"schema": {"type": "integer"}, "description": "seconds"}}
    return out


def openapi_document(max_body_bytes: int) -> dict[str, Any]:
    """The whole document: the two upload routes, their auth and project header, bodies, receipts and refusals."""
    project = {
        "name": "X-Project-ID",
        "in": "header",
        "required": False,
        "description": "the project (tenant) of the API key; optional (a key belongs to one project), refused when "
        "it names another",
        "schema": {"type": "string", "minLength": 1},
    }
    body_limit = f"at most {max_body_bytes} bytes (feedback.maxBodyBytes)"
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "onlinerl feedback",
            "version": "1",
            "description": "Continue's accept / reject outcomes: stock Continue's dev-data upload (data: destination, "
            f"{DATA_PATH}) and the fork's completion tracking upload (completionTrackingUrl, {SUBMIT_PATH})",
        },
        "paths": {
            SUBMIT_PATH: {
                "post": {
                    "operationId": "submitOutcome",
                    "security": [{"bearer": []}],
                    "parameters": [project],
                    "requestBody": {
                        "required": True,
                        "description": body_limit,
                        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Outcome"}}},
                    },
                    "responses": {
                        "200": {
                            "description": "recorded (or recognised as a duplicate)",
                            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Receipt"}}},
                        },
                        **{str(code): _refusal(code) for code in REFUSALS},
                    },
                }
            },
            DATA_PATH: {
                "post": {
                    "operationId": "submitContinueDevData",
                    "description": "stock Continue's `data:` destination (config.yaml: destination, schema 0.2.0, "
                    "level all, events [autocomplete], apiKey)",
                    "security": [{"bearer": []}],
                    "parameters": [project],
                    "requestBody": {
                        "required": True,
                        "description": body_limit,
                        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Envelope"}}},
                    },
                    "responses": {
                        "200": {
                            "description": "recorded, audited, or counted and ignored",
                            "content": {
                                "application/json": {"schema": {"$ref": "#/components/schemas/EnvelopeReceipt"}}
                            },
                        },
                        **{str(code): _refusal(code) for code in REFUSALS},
                    },
                }
            },
        },
        "components": {
            "schemas": {
                "Outcome": outcome_schema(),
                "Receipt": RECEIPT_SCHEMA,
                "Refusal": REFUSAL_SCHEMA,
                "Envelope": ENVELOPE_SCHEMA,
                "EnvelopeReceipt": ENVELOPE_RECEIPT_SCHEMA,
            },
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }


__all__ = ["DATA_PATH", "REFUSALS", "SUBMIT_PATH", "openapi_document", "outcome_schema"]
