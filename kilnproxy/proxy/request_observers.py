"""What a request's record carries for the parts above the proxy that watch it: ``RequestRecord.tap``
(the inspector's capture) and ``RequestRecord.trace`` (its spans, when tracing is on).

The proxy knows them only by these protocols; the inspector (``kilnproxy.inspector.capture.Tap``) and
the tracing (``kilnproxy.ops.tracing.request_trace``: ``RequestTrace``, ``Unsampled``) implement them.
Both are ``None`` when their part is off, and the request path checks that once where it calls them.
What the gateway is handed for every request (the capture ring, the tracer, the row observers, the
commit listeners) is declared beside ``Gateway`` (``gateway``).
"""

from __future__ import annotations

import asyncio
from typing import Protocol


class Tap(Protocol):
    """One request's capture: the bytes it carried, each given once, as they pass."""

    def sent_upstream(self, payload: bytes) -> None:
        """The body sent upstream (after the stream rules and ``rewrite_request``)."""

    def answer(self, upstream: bytes, client: bytes) -> None:
        """A JSON answer: the upstream's bytes, and the client's."""

    def upstream_chunk(self, chunk: bytes) -> None:
        """A stream: each chunk of the upstream's body, as read."""

    def client_write(self, data: bytes) -> None:
        """A stream: each write to the client (events, keep-alives, the usage chunk, ``[DONE]``)."""


class RequestTrace(Protocol):
    """One request's spans (sampled or not: an unsampled trace still carries the client's trace context)."""

    def admission(self) -> RequestTrace:
        """A context manager around the request's admission (its ``__enter__``/``__exit__``)."""

    def __enter__(self) -> None: ...

    def __exit__(self, kind, exc, tb) -> None: ...

    def model(self, requested: str) -> None:
        """The model the client asked for, once the body is read."""

    def attempt(self, base_url: str, headers: dict) -> dict:
        """An attempt on an upstream begins: the headers to send, with the trace's context added."""

    def attempt_done(self, status: int | None, problem: str | None = None) -> None:
        """The attempt's answer status, or the name of what failed it."""

    def first_token(self, ttft_ms: float) -> None:
        """The first byte of the answer came, ``ttft_ms`` after the request."""

    def stream_started(self) -> None:
        """The stream's head went to the client."""

    def end(self, row: dict, committed: asyncio.Future) -> None:
        """The request's row is built and submitted; ``committed`` is done once the store has it."""
