"""The gateway's errors in Anthropic's form, for ``/v1/messages``: same status, Anthropic's body.

``{"type": "error", "error": {"type": T, "message": M}}``, ``T`` chosen by the
status as Anthropic's API does, so that its SDK raises the exception class a
client expects (``AuthenticationError`` for 401, ``RateLimitError`` for 429, ...).
A failure of the upstream (502), which the completion endpoints answer in
plain text, is an ``api_error`` here: Anthropic's clients read every error as JSON.
"""

from __future__ import annotations

from typing import Mapping

from ...answers import Answer
from ...errors import GatewayError, UpstreamFailure, error_json

TYPES = {400: "invalid_request_error", 401: "authentication_error", 402: "billing_error",
         403: "permission_error", 404: "not_found_error", 408: "timeout_error", 413: "request_too_large",
         429: "rate_limit_error", 503: "overloaded_error", 504: "timeout_error", 529: "overloaded_error"}
# The type of the error event that ends a stream the gateway cannot finish, by its code (else api_error).
STREAM_TYPES = {"upstream_timeout": "timeout_error", "shutting_down": "overloaded_error"}


def error_type(status: int) -> str:
    return TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def anthropic_error(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def anthropic_error_response(err: GatewayError | UpstreamFailure,
                             headers: Mapping[str, str] | None = None) -> Answer:
    message = err.message if isinstance(err, GatewayError) else f"Bad gateway: {err}"
    extra = dict(err.headers) if isinstance(err, GatewayError) else {}
    return Answer(error_json(anthropic_error(err.status, message)), err.status, headers={**extra, **(headers or {})})
