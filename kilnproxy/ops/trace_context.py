"""W3C trace context (``traceparent``, ``tracestate``) and the sampling decision, without a dependency.

``parent(headers)`` reads the client's headers as OpenTelemetry's propagator does: a
``traceparent`` that does not match the W3C format (an unknown version ``ff``, version ``00``
with more fields, an all-zero trace or span id) is ignored, and so is a ``tracestate`` with a
malformed or repeated member or more than 32 members (it is dropped, the trace kept).

``Sampler`` decides as ``ParentBased(TraceIdRatioBased(ratio))``: a request with a valid parent
is sampled exactly when the parent's flags say so; a new trace is sampled when the low 64 bits of
its id are below ``ratio`` × 2⁶⁴.
"""

from __future__ import annotations

import re
from typing import NamedTuple

_TRACEPARENT = re.compile(r"^[ \t]*([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?[ \t]*$")
_KEY = r"[a-z][_0-9a-z\-\*\/]{0,255}|[a-z0-9][_0-9a-z\-\*\/]{0,240}@[a-z][_0-9a-z\-\*\/]{0,13}"
_VALUE = r"[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]"
_MEMBER = re.compile(f"({_KEY})=({_VALUE})")
MAX_MEMBERS = 32
_LOW_64 = (1 << 64) - 1


class Parent(NamedTuple):
    trace_id: bytes   # 16 bytes
    span_id: bytes    # 8 bytes
    sampled: bool
    trace_state: str  # "" or the members, "key=value" joined by ","


def parent(headers) -> Parent | None:
    """The client's span, from ``traceparent``/``tracestate`` (``headers``: a mapping with ``get``)."""
    value = headers.get("traceparent")
    if not value:
        return None
    match = _TRACEPARENT.match(value)
    if match is None:
        return None
    version, trace_id, span_id, flags, more = match.groups()
    if version == "ff" or (version == "00" and more) or trace_id == "0" * 32 or span_id == "0" * 16:
        return None
    state = headers.get("tracestate")
    return Parent(bytes.fromhex(trace_id), bytes.fromhex(span_id), bool(int(flags, 16) & 1),
                  trace_state(state) if state else "")


def trace_state(header: str) -> str:
    """The valid ``tracestate``, written as OpenTelemetry writes it back; ``""`` when any member is bad."""
    pairs: dict[str, str] = {}
    for member in header.split(","):
        member = member.strip(" \t")
        if not member:
            continue
        match = _MEMBER.fullmatch(member)
        if match is None or match[1] in pairs:
            return ""
        pairs[match[1]] = match[2]
    if len(pairs) > MAX_MEMBERS:
        return ""
    return ",".join(f"{k}={v}" for k, v in pairs.items())


class Sampler:
    """``ParentBased(TraceIdRatioBased(ratio))``."""

    __slots__ = ("bound",)

    def __init__(self, ratio: float):
        self.bound = round(ratio * (_LOW_64 + 1))

    def new_trace(self, trace_id: int) -> bool:
        """Whether a trace that starts here (``trace_id`` as an integer) is sampled."""
        return trace_id & _LOW_64 < self.bound
