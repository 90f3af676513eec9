"""Errors a client can meet, in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.

Handlers raise `ApiError`; the app turns it (and Starlette's own 404/405) into that body, so every
4xx a client sees reads the same whatever route it came from.
"""

from __future__ import annotations

import re

import msgspec

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 409: "conflict_error",
          413: "invalid_request_error", 415: "invalid_request_error", 422: "invalid_request_error",
          429: "rate_limit_error"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.headers = headers  # e.g. Retry-After on a 429
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def internal_error(request_id: str | None) -> ApiError:
    """A 500 a client may see: it names the request for the server's log and never carries the exception's text
    (which may hold paths, ids of other sessions or parts of a prompt)."""
    return ApiError(500, f"internal error: the server's log has the details under request id {request_id}",
                    code="internal_error")


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


_AT_PATH = re.compile(r"- at `\$(.*)`$")
_MISSING = re.compile(r"missing required field `([^`]+)`")


def from_msgspec(exc: Exception) -> ApiError:
    """A msgspec decode or validation failure as a 400 naming the offending field."""
    text = str(exc)
    if isinstance(exc, msgspec.ValidationError):
        match = _AT_PATH.search(text)
        param = None
        if match:
            # "$.messages[0].role" -> "messages[0].role"
            param = match.group(1).lstrip(".") or None
        missing = _MISSING.search(text)
        if missing:
            param = f"{param}.{missing.group(1)}" if param else missing.group(1)
        return ApiError(400, f"invalid request: {text}", param=param, code="invalid_type")
    return ApiError(400, f"the request body is not valid JSON: {text}", code="invalid_json")
