"""``Call``: what plugins are told about the request they run for."""

from __future__ import annotations

from typing import Any, Callable, Mapping

_EMPTY: Mapping[str, Any] = {}


class Call:
    """One request to /v1/completions or /v1/chat/completions.

    Plugins read it; only ``state`` (a dict that lives as long as the request)
    is theirs to write. ``gateway`` is the running ``Gateway``, the object
    ``startup`` received: key per-gateway resources by it.
    """

    __slots__ = (
        "generation_id", "org", "key_id", "model", "endpoint", "stream",
        "include_usage", "upstream_model", "upstream", "pricing", "state", "_settings", "gateway",
    )

    def __init__(
        self,
        generation_id: str,
        org: str,
        key_id: str,
        endpoint: str,
        settings: Callable[[str], Mapping[str, Any]] | None = None,
    ):
        self.generation_id = generation_id
        self.org = org
        self.key_id = key_id
        self.endpoint = endpoint
        self.model: str | None = None
        self.stream = False
        self.include_usage = False
        self.upstream_model: str | None = None
        self.upstream: str | None = None
        self.pricing = None  # the model's kilnproxy.config.Pricing, once the model is known
        self.state: dict[str, Any] = {}
        self._settings = settings
        self.gateway = getattr(settings, "__self__", None)  # settings is the gateway's plugin_settings

    def settings(self, name: str) -> Mapping[str, Any]:
        """The ``[plugins.settings.<name>]`` table of the config (empty if absent; do not change it)."""
        if self._settings is None:
            return _EMPTY
        return self._settings(name)

    def __repr__(self) -> str:
        return (f"Call({self.generation_id!r}, org={self.org!r}, model={self.model!r}, "
                f"endpoint={self.endpoint!r}, stream={self.stream})")


class _Marker:
    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"kilnproxy.{self.name}"


STOP = _Marker("STOP")
"""Returned by ``transform_event``: end the stream cleanly after this event."""

DROP = _Marker("DROP")
"""Returned by ``transform_event``: do not send this event to the client."""
