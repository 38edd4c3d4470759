"""The one error family of kilnproxy, and the gateway's JSON error responses.

``KilnError`` and its subclasses are *expected* failures: the CLI prints them as
one line and exits non-zero. ``GatewayError`` is an expected failure of one
HTTP request: it knows its status, ``code`` and how to render itself as the
``{"error": {...}}`` body of the request rules (docs/reference.md). Any other exception is a bug.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

import orjson

from .answers import Answer


class KilnError(Exception):
    """A failure the user can fix; printed as one line, no traceback."""


class ConfigError(KilnError):
    """The config file is wrong: the message names the file, the key and the fix."""


class StorageError(KilnError):
    """The usage database cannot be opened for writing."""


class PluginError(KilnError):
    """A plugin could not be loaded, or raised while handling a request."""

    def __init__(self, plugin: str, message: str):
        super().__init__(f"plugin {plugin!r}: {message}")
        self.plugin = plugin


class GatewayError(Exception):
    """A request the gateway answers itself with a JSON error."""

    def __init__(
        self,
        status: int,
        code: str | None,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.type = type
        self.param = param
        self.headers = dict(headers or {})

    def payload(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self, extra_headers: Mapping[str, str] | None = None) -> Answer:
        headers = {**self.headers, **extra_headers} if extra_headers else self.headers
        return Answer(error_json(self.payload()), self.status, headers=headers)


class UpstreamFailure(Exception):
    """The upstream could not give a usable answer; the client gets 502 text/plain."""

    status = 502

    def __init__(self, message: str, code: str = "upstream_error"):
        super().__init__(message)
        self.code = code

    def response(self, extra_headers: Mapping[str, str] | None = None) -> Answer:
        return Answer(f"Bad gateway: {self}\n".encode("utf-8", "backslashreplace"), 502, "text/plain; charset=utf-8",
                      extra_headers)


def error_json(payload: Any) -> bytes:
    """An error's JSON. Its message may quote the client's text, which may hold a lone surrogate (a JSON
    body may escape one): orjson refuses it, the json module writes it as the escape it came as."""
    try:
        return orjson.dumps(payload)
    except TypeError:
        return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "backslashreplace")


def invalid_api_key() -> GatewayError:
    return GatewayError(
        401,
        "invalid_api_key",
        "Invalid API key. Send 'Authorization: Bearer <key>' (on /v1/messages and the GET endpoints, or "
        "'x-api-key: <key>') with a key the gateway knows.",
        type="authentication_error",
    )


def forbidden(message: str) -> GatewayError:
    return GatewayError(403, "forbidden", message, type="permission_error")


def bad_request(message: str, param: str | None = None, code: str = "invalid_request") -> GatewayError:
    return GatewayError(400, code, message, param=param)


def model_not_found(model: object) -> GatewayError:
    return GatewayError(
        404,
        "model_not_found",
        f"The model `{model}` does not exist or you do not have access to it.",
        param="model",
    )


def no_backend_available(model: str) -> GatewayError:
    return GatewayError(
        503,
        "no_backend_available",
        f"Every upstream of model `{model}` is marked down. Retry with exponential backoff.",
        type="service_unavailable",
    )


def plugin_failed(plugin: str, hook: str, exc: BaseException) -> GatewayError:
    return GatewayError(
        500,
        "plugin_error",
        f"Plugin {plugin!r} raised in {hook}: {type(exc).__name__}: {exc}",
        type="server_error",
    )
