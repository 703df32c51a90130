"""OpenAI-style error bodies: ``{"error": {"message", "type", "param", "code"}}`` (docs/architecture.md)."""

from __future__ import annotations

import orjson
from starlette.responses import Response

from onlinerl.http_errors import error_body


class ApiError(Exception):
    """A request we answer with an error status; ``message`` tells the client what to fix."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.retry_after = retry_after

    def body(self) -> bytes:
        return orjson.dumps(error_body(self.message, type_=self.type, param=self.param, code=self.code))

    def response(self, headers: dict[str, str] | None = None) -> Response:
        hdrs = dict(headers or {})
        if self.retry_after is not None:
            hdrs["Retry-After"] = str(self.retry_after)
        return Response(self.body(), status_code=self.status, media_type="application/json", headers=hdrs)


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def unauthorized() -> ApiError:
    return ApiError(
        401,
        "missing or unknown API key: send `Authorization: Bearer <key>` (or `api-key: <key>`)",
        type_="authentication_error",
        code="invalid_api_key",
    )


def pin_forbidden(role: str) -> ApiError:
    return ApiError(
        403,
        f"this API key has role {role!r}, which may not pin a policy version: drop the X-OnlineRL-Version header "
        "to be routed, or use a key with role eval or admin (keys file: `{key: <key>, role: eval}`)",
        type_="permission_error",
        param="X-OnlineRL-Version",
        code="version_pin_forbidden",
    )


def wrong_project(header: str, named: str, tenant: str) -> ApiError:
    """A header naming another project than the key's (issue 39): a key is served its own project's policy only."""
    return ApiError(
        403,
        f"{header} names project {named[:80]!r}, but this API key belongs to project {tenant!r}: a key is served "
        f"its own project's policy only; drop {header} or send the key's own project",
        type_="permission_error",
        param=header,
        code="wrong_project",
    )


def unavailable(message: str, retry_after: int) -> ApiError:
    return ApiError(503, message, type_="service_unavailable", code="engine_unavailable", retry_after=retry_after)


def engine_timeout(timeout_s: float) -> ApiError:
    """The engine is up but did not answer within ``serving.requestTimeoutSeconds``: 504, no Retry-After (the same
    request would time out again)."""
    return ApiError(
        504,
        f"the inference engine did not finish this request within {timeout_s:g} s (serving.requestTimeoutSeconds): "
        "ask for fewer tokens (max_tokens) or a shorter prompt, or raise the timeout",
        type_="server_error",
        param="max_tokens",
        code="engine_timeout",
    )
