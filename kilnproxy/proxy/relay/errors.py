"""The error events a stream can end with once it has begun (its status line has gone)."""

from __future__ import annotations

from ...errors import error_json, plugin_failed
from ...sse import data_frame


class StreamPluginError(Exception):
    """A ``transform_event`` plugin raised after the stream had started. ``before``: the frames of the
    events the plugins had let through before it, which go out ahead of the error event."""

    before = b""

    def __init__(self, plugin: str, exc: BaseException):
        super().__init__(f"{plugin}: {exc}")
        self.error = plugin_failed(plugin, "transform_event", exc)

    def frame(self) -> bytes:
        return data_frame(error_json(self.error.payload()))


def error_frame(message: str, code: str, kind: str = "upstream_error") -> bytes:
    """The ``error`` event the gateway sends when a stream cannot go on (``kind``: the error's ``type``)."""
    return data_frame(error_json({"error": {"message": message, "type": kind, "param": None, "code": code}}))
