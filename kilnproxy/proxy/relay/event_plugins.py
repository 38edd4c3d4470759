"""A ``transform_event`` plugin as the relays call it: a function of the event alone, bound once per stream.

Used by both relays (``plain_relay``'s ``PluggedEvents``, ``framed_relay``), so that the call per
event is the plugin's own function wherever its arguments allow.
"""

from __future__ import annotations

from types import MethodType
from typing import Any, Callable

from ...call import Call
from ...plugins.manager import Impl, call_impl


def event_only(impl: Impl, call: Call) -> Callable[[dict], Any]:
    """A ``transform_event`` implementation as a function of the event alone, its ``call`` bound
    once per stream (pluggy passes arguments by name; these are its names in order). ``call``
    first is bound as a method's ``self`` is: the interpreter calls a bound method of a
    function as the function itself, in the caller's loop, where a ``partial`` is a C call."""
    function, names = impl.function, impl.argnames
    if names == ("event",):
        return function
    if names == ("call", "event"):
        return MethodType(function, call)
    if names == ("event", "call"):
        return lambda event: function(event, call)
    if names == ("call",):
        return lambda event: function(call)
    if not names:
        return lambda event: function()
    return lambda event: call_impl(impl, {"call": call, "event": event})
