"""Errors of the HTTP API in OpenAI's JSON shape, and how the gRPC status codes map onto them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# OpenAI's error types by HTTP status (what its SDKs and tools look at besides the status).
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    499: "cancelled",
    500: "internal_server_error",
    503: "service_unavailable",
}

# A stream that ends with a gRPC status (gateway/request.py StreamError) answers this HTTP
# status when nothing was sent yet.
STATUS_OF_GRPC_CODE = {
    "INVALID_ARGUMENT": 400,
    "RESOURCE_EXHAUSTED": 429,
    "UNAVAILABLE": 503,
    "CANCELLED": 499,
    "DEADLINE_EXCEEDED": 503,
}


@dataclass
class ApiError(Exception):
    """A request that is answered with an error: `status` and the body of `payload()`."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None
    # What the refusal counter and log call it (gateway/refusals.py) when neither `code` nor
    # a known `param` says it: a fixed word, never text from the client.
    reason: str = ""

    def __str__(self) -> str:
        return self.message

    def payload(self) -> dict[str, Any]:
        return {"error": {
            "message": self.message,
            "type": _TYPES.get(self.status, "invalid_request_error"),
            "param": self.param,
            "code": self.code if self.code is not None else self.status,
        }}


def invalid(message: str, param: str | None = None, reason: str = "") -> ApiError:
    """A 400 for a parameter that cannot be served as sent."""
    return ApiError(400, message, param=param, reason=reason)


def from_grpc_code(code_name: str, message: str) -> ApiError:
    return ApiError(STATUS_OF_GRPC_CODE.get(code_name, 500), message)
