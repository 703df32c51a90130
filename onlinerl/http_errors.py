"""The OpenAI-style error body every HTTP service answers with: ``{"error": {"message", "type", "param", "code"}}``.

Defined once so the gateway, the feedback service and the weights gate cannot drift apart (docs/architecture.md:
errors). Clients (Continue, the OpenAI SDKs) read ``error.message``; ``param`` names the field to fix.
"""

from __future__ import annotations

# OpenAI's ``type`` for each status we answer with; a service may pass a more precise type of its own.
ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


def error_type(status: int) -> str:
    """The ``type`` for ``status``; anything not listed is the client's request to fix."""
    return ERROR_TYPES.get(status, "invalid_request_error")


def error_object(
    message: str, *, type_: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict[str, str | None]:
    """The inner ``error`` object; ``message`` says what to fix, ``param`` names the field."""
    return {"message": message, "type": type_, "param": param, "code": code}


def error_body(
    message: str, *, type_: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict[str, dict[str, str | None]]:
    """``{"error": error_object(...)}``: the whole body of an error reply (or of an SSE error event)."""
    return {"error": error_object(message, type_=type_, param=param, code=code)}
