"""W3C trace context (``traceparent``, ``tracestate``) and the sampling decision, without a dependency.

``parent(headers)`` reads the client's headers as the W3C Trace Context recommendation says:

* a ``traceparent`` that does not match the format (version ``ff``, version ``00`` with more
  fields, a field of the wrong length, uppercase hex, an all-zero trace or parent id) is
  ignored, and so is one sent in two header fields; a later version is read by its first four
  fields, whatever follows them after a dash;
* ``tracestate`` is read only with a valid ``traceparent``; its header fields are one list, in
  their order. A list with a malformed member or more than 32 members is dropped (the trace
  kept); a key that repeats keeps its first member; a list over ``MAX_STATE_CHARS`` characters
  loses whole members, those over 128 characters first (right-most first), then from its end.

``Sampler`` decides as ``ParentBased(TraceIdRatioBased(ratio))``: a request with a valid parent
is sampled exactly when the parent's flags say so; a new trace is sampled when the low 64 bits of
its id are below ``ratio`` × 2⁶⁴.
"""

from __future__ import annotations

import re
from typing import NamedTuple

_TRACEPARENT = re.compile(r"[ \t]*([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?[ \t]*\Z")
_KEY = r"[a-z][_0-9a-z\-\*\/]{0,255}|[a-z0-9][_0-9a-z\-\*\/]{0,240}@[a-z][_0-9a-z\-\*\/]{0,13}"
_VALUE = r"[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]"
_MEMBER = re.compile(f"({_KEY})=({_VALUE})")
MAX_MEMBERS = 32
MAX_STATE_CHARS = 512  # what the recommendation asks a vendor to pass on at least; a longer list is cut
LONG_MEMBER = 128  # members longer than this go first when a list is cut
_LOW_64 = (1 << 64) - 1


class Parent(NamedTuple):
    trace_id: bytes   # 16 bytes
    span_id: bytes    # 8 bytes
    sampled: bool
    trace_state: str  # "" or the members, "key=value" joined by ","


def parent(headers) -> Parent | None:
    """The client's span, from ``traceparent``/``tracestate`` (``headers``: a multidict, or a mapping
    with ``get`` holding one field a name)."""
    value = headers.get("traceparent")
    if not value:
        return None
    match = _TRACEPARENT.match(value)
    if match is None:
        return None
    version, trace_id, span_id, flags, more = match.groups()
    if version == "ff" or (version == "00" and more) or trace_id == "0" * 32 or span_id == "0" * 16:
        return None
    getall = getattr(headers, "getall", None)
    if getall is not None and len(getall("traceparent")) > 1:
        return None
    state = headers.get("tracestate")
    if state is not None and getall is not None:
        state = ",".join(getall("tracestate"))
    return Parent(bytes.fromhex(trace_id), bytes.fromhex(span_id), bool(int(flags, 16) & 1),
                  trace_state(state) if state else "")


def trace_state(header: str) -> str:
    """The valid ``tracestate`` (its fields joined by ``,``), written back without optional white
    space: ``""`` when a member is malformed or there are more than ``MAX_MEMBERS``; a repeated key's
    later members left out; cut to ``MAX_STATE_CHARS`` (``_cut``)."""
    pairs: dict[str, str] = {}
    count = 0
    for member in header.split(","):
        member = member.strip(" \t")
        if not member:
            continue
        count += 1
        match = _MEMBER.fullmatch(member) if count <= MAX_MEMBERS else None
        if match is None:
            return ""
        pairs.setdefault(match[1], match[2])
    members = [f"{k}={v}" for k, v in pairs.items()]
    if sum(map(len, members)) + len(members) - 1 > MAX_STATE_CHARS:
        members = _cut(members)
    return ",".join(members)


def _cut(members: list[str]) -> list[str]:
    """Whole members left out until the list fits ``MAX_STATE_CHARS``: the right-most of those longer than
    ``LONG_MEMBER`` first, then the right-most."""
    members = list(members)
    length = sum(map(len, members)) + len(members) - 1
    for i in reversed(range(len(members))):
        if length <= MAX_STATE_CHARS:
            return members
        if len(members[i]) > LONG_MEMBER:
            length -= len(members.pop(i)) + 1
    while length > MAX_STATE_CHARS:
        length -= len(members.pop()) + 1
    return members


class Sampler:
    """``ParentBased(TraceIdRatioBased(ratio))``."""

    __slots__ = ("bound",)

    def __init__(self, ratio: float):
        self.bound = round(ratio * (_LOW_64 + 1))

    def new_trace(self, trace_id: int) -> bool:
        """Whether a trace that starts here (``trace_id`` as an integer) is sampled."""
        return trace_id & _LOW_64 < self.bound
