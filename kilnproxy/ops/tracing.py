"""OpenTelemetry traces of the completion requests (``[tracing]``; no dependency).

``install(app)`` does nothing unless ``[tracing] enabled = true``; then it
hands the request path a ``Tracing`` object (``Gateway.tracer``) that sends
spans in batches over OTLP/HTTP (``endpoint``, headers from ``headers_env``),
sampled at ``sample_ratio`` for traces that start here and as the client
said for the others (``trace_context``). With tracing off, the request path
checks ``gw.tracer is None`` once per request and pays nothing else.

The spans are not the OpenTelemetry SDK's: its span objects, their garbage
and its protobuf encoder cost more than the request itself. A span here is a
few fields of ``RequestTrace`` while it runs, and the bytes of its OTLP
protobuf (``otlp_wire``) once it ends; an unsampled request is an id to pass
upstream and nothing else.

One span per completion request, named ``"{gen_ai.operation.name}
{gen_ai.request.model}"`` (``chat qwen3-32b``, ``text_completion qwen3-32b``),
kind SERVER, a child of the client's W3C ``traceparent``/``tracestate``
(a malformed one is ignored: a new trace). Attributes follow the GenAI
semantic conventions (``gen_ai.operation.name``, ``gen_ai.request.model``,
``gen_ai.response.model``, ``gen_ai.usage.input_tokens``,
``gen_ai.usage.output_tokens``) plus ``http.response.status_code``,
``error.type`` (the error code), ``kilnproxy.org``,
``kilnproxy.generation_id`` and ``kilnproxy.cost_usd``. Its children:

* ``kilnproxy.admission``: the in-flight slot and the credit hold;
* ``kilnproxy.upstream`` (kind CLIENT), one per upstream tried, with
  ``server.address`` (the upstream's base URL) and its status or
  ``error.type``; the upstream request carries this span as its
  ``traceparent``, so a model server that traces continues the trace;
* ``kilnproxy.stream``: the relay of a streamed answer, from its first
  event to ``[DONE]`` (``kilnproxy.disconnected`` when the client left);
* ``kilnproxy.usage_commit``: from the row's submission to its commit.

Time to first token is the event ``gen_ai.first_token`` on the request span.
Spans are ended and handed to the exporter as soon as their part ends, so
nothing of a stream's spans outlives the stream.

Spans wait for their export in a queue of at most ``max_queue_size`` and are
sent from a thread of their own; an endpoint that is away costs requests
nothing, its spans are dropped and said so once a minute
(``kilnproxy.ops.trace_export``).

With ``trace_url`` set, the trace id of each sampled request is kept for the
last ``KEEP_LINKS`` requests (``Tracing.link``): the inspector's detail of a
request links to its trace. The usage table is not changed, so a request
another replica served has no link on this one.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import traceback
from collections import OrderedDict
from random import getrandbits
from time import time_ns
from urllib.parse import unquote

from aiohttp import web

from .. import __version__
from ..config_types import TracingConfig
from ..proxy.gateway import GATEWAY
from . import otlp_wire as wire
from .trace_context import Sampler, parent
from .trace_export import OtlpHttp, QuietExporter, SpanQueue

log = logging.getLogger("kilnproxy")

KEEP_LINKS = 10_000  # requests whose trace id is kept for the inspector's link (about 1 MB)

# gen_ai.operation.name of each endpoint (the GenAI semantic conventions' names)
OPERATIONS = {"chat/completions": "chat", "completions": "text_completion", "embeddings": "embeddings",
              "responses": "chat", "messages": "chat"}

_ATTRIBUTE, _UNIQUE, _NO_STATUS = wire.attribute, wire.unique, wire.status(None)


def install(app: web.Application) -> None:
    gw = app[GATEWAY]
    if not gw.config.tracing.enabled:
        return
    tracing = Tracing(gw.config.tracing)

    async def lifetime(app: web.Application):
        gw.tracer = tracing
        yield
        gw.tracer = None
        await asyncio.get_running_loop().run_in_executor(None, tracing.close)  # it blocks while it sends

    app.cleanup_ctx.append(lifetime)


def resource(service_name: str) -> dict[str, str]:
    """The resource of every span: as the SDK's (``OTEL_RESOURCE_ATTRIBUTES`` read), ``service_name``'s name."""
    found: dict[str, str] = {"telemetry.sdk.language": "python", "telemetry.sdk.name": "kilnproxy",
                             "telemetry.sdk.version": __version__}
    for item in os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "").split(","):
        key, eq, value = item.partition("=")
        if eq and key.strip():
            found[key.strip()] = unquote(value.strip())
    found["service.name"] = service_name
    return found


class Tracing:
    """Where each request's trace starts, and the queue its spans go to.

    ``send``: what posts one encoded batch (``OtlpHttp`` to ``endpoint`` unless a test gives its own)."""

    def __init__(self, config: TracingConfig, send=None):
        self.sampler = Sampler(config.sample_ratio)
        self.framing = wire.Framing(resource(config.service_name), "kilnproxy")
        self.timeout = config.timeout
        stopping = threading.Event()
        self.sender = send if send is not None else OtlpHttp(config.endpoint, dict(config.headers), config.timeout,
                                                              stopping)
        self.exporter = QuietExporter(self.sender, config.endpoint)
        self.processor = SpanQueue(self.exporter, self.framing.request, config.max_queue_size, stopping=stopping)
        self.add = self.processor.add
        self.trace_url = config.trace_url
        self.trace_ids: OrderedDict[str, str] | None = OrderedDict() if config.trace_url else None

    def begin(self, headers, endpoint: str, call) -> "RequestTrace | Unsampled":
        """The request's trace, a child of the client's ``traceparent`` when it sent a valid one."""
        client = parent(headers)
        if client is None:
            number = getrandbits(128) or 1
            trace_id, parent_id, state = number.to_bytes(16, "big"), None, ""
            sampled = self.sampler.new_trace(number)
        else:
            trace_id, parent_id, sampled, state = client
        if not sampled:
            return Unsampled(trace_id, state)
        trace = RequestTrace(self, trace_id, parent_id, state, endpoint, call)
        ids = self.trace_ids
        if ids is not None:
            ids[call.generation_id] = trace_id.hex()
            if len(ids) > KEEP_LINKS:
                ids.popitem(last=False)
        return trace

    def link(self, generation_id: str) -> dict | None:
        """``{"trace_id", "url"}`` of a request this process traced (``trace_url`` set, sampled, among
        the last ``KEEP_LINKS``); the template's ``{trace_id}`` replaced as plain text."""
        trace_id = self.trace_ids.get(generation_id) if self.trace_ids is not None else None
        if trace_id is None:
            return None
        return {"trace_id": trace_id, "url": self.trace_url.replace("{trace_id}", trace_id)}

    def close(self) -> None:
        """Send what is still queued (``timeout`` at most: an endpoint that is away does not hold the shutdown
        up, its retries end at once), then stop the exporter's thread."""
        self.processor.shutdown(self.timeout)
        close = getattr(self.sender, "close", None)
        if close is not None:
            close()


def _new_span_id() -> bytes:
    return (getrandbits(64) or 1).to_bytes(8, "big")


def _traceparent(trace_id: bytes, span_id: bytes, sampled: bool) -> str:
    return f"00-{trace_id.hex()}-{span_id.hex()}-{'01' if sampled else '00'}"


class Unsampled:
    """A request whose spans are not recorded: its trace still goes upstream (flags ``00``), as the SDK's
    non-recording spans pass it on."""

    __slots__ = ("_trace_id", "_state")

    trace_id = None  # nothing sent: no link

    def __init__(self, trace_id: bytes, state: str):
        self._trace_id = trace_id
        self._state = state

    def admission(self) -> "Unsampled":
        return self

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, exc, tb) -> None:
        return None

    def attempt(self, base_url: str, headers: dict) -> dict:
        carrier = dict(headers)
        carrier["traceparent"] = _traceparent(self._trace_id, _new_span_id(), False)
        if self._state:
            carrier["tracestate"] = self._state
        return carrier

    def model(self, requested: str) -> None:
        pass

    def attempt_done(self, status: int | None, problem: str | None = None) -> None:
        pass

    def first_token(self, ttft_ms: float) -> None:
        pass

    def stream_started(self) -> None:
        pass

    def stream_ended(self, disconnected: bool) -> None:
        pass

    def end(self, row: dict, committed) -> None:
        pass


class RequestTrace:
    """One sampled request's spans; the request path calls it at each part (``kilnproxy.proxy``). Each child
    span is encoded and queued when it ends; the request's own span when the row is committed."""

    __slots__ = ("tracing", "trace", "span_id", "parent_id", "state", "state_field", "prefix", "start", "operation",
                 "name", "head", "requested", "events", "_attempt", "_stream", "_admitted", "_ending")

    def __init__(self, tracing: Tracing, trace_id: bytes, parent_id: bytes | None, state: str, endpoint: str,
                 call):
        self.start = time_ns()
        self.tracing = tracing
        self.trace = trace_id
        self.span_id = _new_span_id()
        self.parent_id = parent_id
        self.state = state
        self.state_field = wire.field(b"\x1a", state.encode()) if state else b""
        self.prefix = wire.span_prefix(trace_id, self.state_field, self.span_id)
        self.operation = self.name = operation = OPERATIONS.get(endpoint, endpoint)
        self.head = b"".join((_ATTRIBUTE(b"J", "gen_ai.operation.name", operation),
                              _ATTRIBUTE(b"J", "kilnproxy.org", call.org),
                              _UNIQUE(b"J", "kilnproxy.generation_id", call.generation_id)))
        self.requested = b""
        self.events = b""
        self._attempt = None
        self._stream = None
        self._admitted = 0
        self._ending = None

    @property
    def trace_id(self) -> str:
        """The trace's id in hex (this request's spans are sampled: sent)."""
        return self.trace.hex()

    def child(self, name: str, kind: int, span_id: bytes, start: int, attrs: bytes, events: bytes = b"",
              status: bytes = _NO_STATUS) -> None:
        """A child span that ended now: encoded and queued."""
        self.tracing.add(wire.child_span(self.prefix, span_id, name, kind, start, time_ns(), attrs, events, status))

    def admission(self) -> "RequestTrace":
        """A context manager around the slot and hold: the admission span, ended on the way out (an exception
        recorded on it as an ``exception`` event with an error status, as the SDK's ``use_span`` does)."""
        return self

    def __enter__(self) -> None:
        self._admitted = time_ns()

    def __exit__(self, kind, exc, tb) -> None:
        events, status = b"", _NO_STATUS
        if exc is not None:
            module, name = kind.__module__, kind.__qualname__
            events = wire.event("exception", time_ns(), {
                "exception.type": f"{module}.{name}" if module and module != "builtins" else name,
                "exception.message": str(exc),
                "exception.stacktrace": "".join(traceback.format_exception(exc)), "exception.escaped": "False"})
            status = wire.status(f"{kind.__name__}: {exc}")
        self.child("kilnproxy.admission", wire.INTERNAL, _new_span_id(), self._admitted, b"", events, status)

    def model(self, requested: str) -> None:
        self.requested = _ATTRIBUTE(b"J", "gen_ai.request.model", requested)
        self.name = f"{self.operation} {requested}"

    def attempt(self, base_url: str, headers: dict) -> dict:
        """An upstream attempt begins: its span, and the headers that carry it upstream (W3C trace context,
        written as the SDK's propagator writes it)."""
        span_id = _new_span_id()
        self._attempt = (span_id, time_ns(), base_url)
        carrier = dict(headers)
        carrier["traceparent"] = _traceparent(self.trace, span_id, True)
        if self.state:
            carrier["tracestate"] = self.state
        return carrier

    def attempt_done(self, status: int | None, problem: str | None = None) -> None:
        attempt, self._attempt = self._attempt, None
        if attempt is None:
            return
        span_id, start, base_url = attempt
        attrs = _ATTRIBUTE(b"J", "server.address", base_url)
        if status is not None:
            attrs += _ATTRIBUTE(b"J", "http.response.status_code", status)
        outcome = _NO_STATUS
        if problem is not None or (status is not None and status >= 500):
            attrs += _ATTRIBUTE(b"J", "error.type", problem or str(status))
            outcome = wire.status(problem or f"HTTP {status}")
        self.child("kilnproxy.upstream", wire.CLIENT, span_id, start, attrs, b"", outcome)

    def first_token(self, ttft_ms: float) -> None:
        self.events += wire.event("gen_ai.first_token", time_ns(), {"kilnproxy.ttft_ms": ttft_ms})

    def stream_started(self) -> None:
        self._stream = (_new_span_id(), time_ns())

    def stream_ended(self, disconnected: bool) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            self.child("kilnproxy.stream", wire.INTERNAL, stream[0], stream[1],
                       _ATTRIBUTE(b"J", "kilnproxy.disconnected", disconnected))

    def end(self, row: dict, committed) -> None:
        """The row is submitted: record it on the span, which ends with the row's commit."""
        self.attempt_done(None, "cancelled")
        disconnected = bool(row["disconnected"])
        self.stream_ended(disconnected)
        attrs = [self.head, self.requested]
        for key, value in (("gen_ai.response.model", row["model"] or ""),
                           ("gen_ai.usage.input_tokens", row["prompt_tokens"]),
                           ("gen_ai.usage.output_tokens", row["completion_tokens"]),
                           ("kilnproxy.cost_usd", row["cost"]), ("http.response.status_code", row["status"]),
                           ("kilnproxy.disconnected", disconnected)):
            if value is not None:  # the SDK drops an attribute without a value
                attrs.append(_ATTRIBUTE(b"J", key, value))
        outcome = _NO_STATUS
        if row["error_code"] is not None:
            attrs.append(_ATTRIBUTE(b"J", "error.type", row["error_code"]))
            if row["status"] >= 500 or row["status"] == 200:  # a server fault, or a stream that ended in one
                outcome = wire.status(row["error_code"])
        self._ending = (_new_span_id(), time_ns(), b"".join(attrs), outcome)
        if committed is None or committed.done():
            self._committed(None)
        else:
            committed.add_done_callback(self._committed)

    def _committed(self, _future) -> None:
        """The row is committed: the commit's span and the request's end."""
        commit_id, commit_start, attrs, outcome = self._ending
        self.child("kilnproxy.usage_commit", wire.INTERNAL, commit_id, commit_start, b"")
        self.tracing.add(wire.span(
            self.trace, self.span_id, self.parent_id, self.state_field, self.name, wire.SERVER, self.start,
            time_ns(), attrs, self.events, outcome, wire.FLAGS_LOCAL if self.parent_id is None else wire.FLAGS_REMOTE))
