"""``Call``: what plugins are told about the request they run for."""

from __future__ import annotations

from typing import Any, Callable, Mapping

_EMPTY: Mapping[str, Any] = {}
_set = object.__setattr__  # the gateway's own writes: Call.__setattr__ refuses everyone else's


class Call:
    """One request to /v1/completions or /v1/chat/completions.

    Plugins read it; only ``state`` (a dict that lives as long as the request)
    is theirs to write into. Assigning to (or deleting) any attribute raises
    ``AttributeError``, which fails the plugin's hook as a ``plugin_error``
    naming it: a plugin cannot change whom a request is billed to, at which
    prices, or under which generation id. ``gateway`` is the running
    ``Gateway``, the object ``startup`` received: key per-gateway resources by it.

    ``Call(...)`` builds one whole (a plugin's own tests: the keyword arguments
    are what the gateway would have set). The gateway builds its own with
    ``open_call`` and fills it in as plain slots while no plugin has seen it;
    ``seal`` makes it read-only before the first hook gets it, and the
    gateway's later writes (a fallback's model, the upstream) go through
    ``set_model`` and ``set_upstream``. Reads are plain slot reads either way.
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
        *,
        model: str | None = None,
        upstream_model: str | None = None,
        pricing: Any = None,
        stream: bool = False,
        include_usage: bool = False,
        upstream: str | None = None,
    ):
        _set(self, "__class__", _Writable)
        _Writable.__init__(self, generation_id, org, key_id, endpoint, settings)
        self.model, self.upstream_model, self.pricing = model, upstream_model, pricing
        self.stream, self.include_usage, self.upstream = stream, include_usage, upstream
        self.__class__ = Call

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(_refusal(name))

    def __delattr__(self, name: str) -> None:
        raise AttributeError(_refusal(name))

    def settings(self, name: str) -> Mapping[str, Any]:
        """The ``[plugins.settings.<name>]`` table of the config (empty if absent; do not change it)."""
        if self._settings is None:
            return _EMPTY
        return self._settings(name)

    def __repr__(self) -> str:
        return (f"Call({self.generation_id!r}, org={self.org!r}, model={self.model!r}, "
                f"endpoint={self.endpoint!r}, stream={self.stream})")


class _Writable(Call):
    """A ``Call`` no plugin has seen yet: the same slots, written as plain slots (``object.__setattr__``
    on a ``Call`` costs about 0.1 µs a field, a plain slot write a few ns)."""

    __slots__ = ()
    __setattr__ = object.__setattr__
    __delattr__ = object.__delattr__

    def __init__(self, generation_id: str, org: str, key_id: str, endpoint: str,
                 settings: Callable[[str], Mapping[str, Any]] | None = None):
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


def _refusal(name: str) -> str:
    if name in Call.__slots__:
        return f"call.{name} is read-only: a plugin may change only what call.state holds"
    return f"call has no attribute {name!r} to set: a plugin's own data goes in call.state"


# -- the gateway's side --------------------------------------------------------------

open_call = _Writable
"""``open_call(generation_id, org, key_id, endpoint, settings)``: the gateway's ``Call`` of a new request,
still writable; ``seal`` it before any plugin gets it."""


def seal(call: Call) -> None:
    """From now on ``call`` is read-only (a no-op when it is already)."""
    if type(call) is _Writable:
        call.__class__ = Call


def set_model(call: Call, model: str | None, upstream_model: str | None, pricing: Any) -> None:
    """The catalog model the request is served by (or asked for), its upstream name and prices."""
    if type(call) is _Writable:
        call.model, call.upstream_model, call.pricing = model, upstream_model, pricing
    else:
        _set(call, "model", model)
        _set(call, "upstream_model", upstream_model)
        _set(call, "pricing", pricing)


def set_stream(call: Call, stream: bool, include_usage: bool) -> None:
    if type(call) is _Writable:
        call.stream, call.include_usage = stream, include_usage
    else:
        _set(call, "stream", stream)
        _set(call, "include_usage", include_usage)


def set_upstream(call: Call, upstream: str) -> None:
    """The base URL of the upstream that answered."""
    _set(call, "upstream", upstream)


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
