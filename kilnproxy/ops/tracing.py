"""OpenTelemetry traces of the completion requests (``[tracing]``; the ``tracing`` extra).

``install(app)`` does nothing unless ``[tracing] enabled = true``; then it
imports the OpenTelemetry SDK, builds a tracer provider that sends spans in
batches over OTLP/HTTP (``endpoint``, headers from ``headers_env``), sampled
at ``sample_ratio`` for traces that start here and as the client said for
the others, and hands the request path a ``Tracing`` object
(``Gateway.tracer``). With tracing off, the request path checks
``gw.tracer is None`` once per request and pays nothing else.

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
sent from the SDK's own thread; an endpoint that is away costs requests
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
from collections import OrderedDict

from aiohttp import web

from ..config_types import TracingConfig
from ..proxy.gateway import GATEWAY

log = logging.getLogger("kilnproxy")

KEEP_LINKS = 10_000  # requests whose trace id is kept for the inspector's link (about 1 MB)

# gen_ai.operation.name of each endpoint (the GenAI semantic conventions' names)
OPERATIONS = {"chat/completions": "chat", "completions": "text_completion", "embeddings": "embeddings",
              "responses": "chat", "messages": "chat"}


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


class Tracing:
    """The tracer provider of one gateway, and where each request's trace starts."""

    def __init__(self, config: TracingConfig, exporter=None):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.trace import SpanKind, Status, StatusCode
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = TracerProvider(resource=Resource.create({"service.name": config.service_name}),
                                       sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)))
        from .trace_export import BoundedProcessor, QuietExporter, silence_sdk

        if exporter is None:
            exporter = OTLPSpanExporter(endpoint=config.endpoint, headers=dict(config.headers),
                                        timeout=config.timeout)
        silence_sdk()
        self.timeout = config.timeout
        self.exporter = QuietExporter(exporter, config.endpoint)
        self.processor = BoundedProcessor(self.exporter, config.max_queue_size)
        self.provider.add_span_processor(self.processor)
        self.tracer = self.provider.get_tracer("kilnproxy")
        self.propagator = TraceContextTextMapPropagator()
        self.kinds = SpanKind
        self.error = lambda code: Status(StatusCode.ERROR, code)
        self.new_child = _child_maker(self)
        self.trace_url = config.trace_url
        self.trace_ids: OrderedDict[str, str] | None = OrderedDict() if config.trace_url else None

    def begin(self, headers, endpoint: str, call) -> "RequestTrace":
        """The request's span, a child of the client's ``traceparent`` when it sent a valid one."""
        return RequestTrace(self, self.propagator.extract(headers), endpoint, call)

    def link(self, generation_id: str) -> dict | None:
        """``{"trace_id", "url"}`` of a request this process traced (``trace_url`` set, sampled, among
        the last ``KEEP_LINKS``); the template's ``{trace_id}`` replaced as plain text."""
        trace_id = self.trace_ids.get(generation_id) if self.trace_ids is not None else None
        if trace_id is None:
            return None
        return {"trace_id": trace_id, "url": self.trace_url.replace("{trace_id}", trace_id)}

    def close(self) -> None:
        """Send what is still queued (``timeout`` and one export at most: an endpoint that is away does
        not hold the shutdown up), then stop the exporter's thread."""
        self.processor.shutdown(timeout_millis=self.timeout * 1000)
        self.provider.shutdown()


def _child_maker(tracing: Tracing):
    """``new_child(parent_span, name, kind, attributes)``: a started child span of this process's own span.

    The tracer's ``start_span`` looks the parent up in a context, asks the sampler, builds the sampling
    result and goes through the provider's list of processors: several µs of the event loop per span.
    A child of a span of ours needs none of it (parent-based sampling: sampled exactly when its parent
    is), so it is made as the tracer makes it, with the same resource, scope, limits and ids, and handed
    to the one processor straight away. An SDK without that constructor gets the tracer's way."""
    from opentelemetry.sdk.trace import _Span
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, set_span_in_context

    tracer, processor = tracing.tracer, tracing.processor
    new_span_id = tracer.id_generator.generate_span_id
    resource, limits = tracer.resource, tracer._span_limits
    scope, info = tracer._instrumentation_scope, tracer.instrumentation_info
    sampler, internal = tracer.sampler, tracing.kinds.INTERNAL

    def by_the_tracer(parent, name, kind=internal, attributes=None):
        return tracer.start_span(name, context=set_span_in_context(parent), kind=kind, attributes=attributes)

    def new_child(parent, name, kind=internal, attributes=None):
        context = parent.get_span_context()
        if not context.trace_flags.sampled:  # not recorded, but its id is sent upstream
            return NonRecordingSpan(SpanContext(context.trace_id, new_span_id(), False, context.trace_flags,
                                                context.trace_state))
        span = _Span(name, SpanContext(context.trace_id, new_span_id(), False, context.trace_flags,
                                       context.trace_state),
                     context, sampler, None, resource, attributes, None, (), kind, processor, info,
                     limits=limits, instrumentation_scope=scope)
        span.start()
        return span

    try:  # the constructor's arguments as this SDK has them (a span started, never ended: never sent)
        new_child(NonRecordingSpan(SpanContext(1, 1, False, TraceFlags(TraceFlags.SAMPLED))), "probe")
    except Exception:  # an SDK whose private constructor differs
        return by_the_tracer
    return new_child


class _Admission:
    """``with trace.admission():`` the admission span, ended on the way out (an exception recorded on it, as
    the SDK's ``use_span`` does), without making it the current span: nothing under it starts spans."""

    __slots__ = ("trace", "span")

    def __init__(self, trace: "RequestTrace"):
        self.trace = trace
        self.span = None

    def __enter__(self):
        self.span = self.trace.child("kilnproxy.admission")
        return self.span

    def __exit__(self, kind, exc, tb) -> None:
        span = self.span
        if exc is not None and span.is_recording():
            span.record_exception(exc)
            span.set_status(self.trace.tracing.error(f"{kind.__name__}: {exc}"))
        span.end()


class RequestTrace:
    """One request's spans; the request path calls it at each part (``kilnproxy.proxy``)."""

    __slots__ = ("tracing", "span", "operation", "_attempt", "_stream")

    def __init__(self, tracing: Tracing, parent, endpoint: str, call):
        self.tracing = tracing
        self.operation = OPERATIONS.get(endpoint, endpoint)
        self.span = tracing.tracer.start_span(self.operation, context=parent, kind=tracing.kinds.SERVER, attributes={
            "gen_ai.operation.name": self.operation, "kilnproxy.org": call.org,
            "kilnproxy.generation_id": call.generation_id})
        self._attempt = None
        self._stream = None
        ids = tracing.trace_ids
        if ids is not None and (trace_id := self.trace_id) is not None:
            ids[call.generation_id] = trace_id
            if len(ids) > KEEP_LINKS:
                ids.popitem(last=False)

    @property
    def trace_id(self) -> str | None:
        """The trace's id in hex, when this request's spans are sampled (sent); else ``None``."""
        context = self.span.get_span_context()
        return format(context.trace_id, "032x") if context.trace_flags.sampled else None

    def child(self, name: str, kind=None, attributes=None):
        return self.tracing.new_child(self.span, name, kind or self.tracing.kinds.INTERNAL, attributes)

    def admission(self) -> _Admission:
        """A context manager around the slot and hold."""
        return _Admission(self)

    def model(self, requested: str) -> None:
        self.span.set_attribute("gen_ai.request.model", requested)
        self.span.update_name(f"{self.operation} {requested}")

    def attempt(self, base_url: str, headers: dict) -> dict:
        """An upstream attempt begins: its span, and the headers that carry it upstream (W3C trace context,
        written as the SDK's propagator writes it)."""
        span = self._attempt = self.child("kilnproxy.upstream", self.tracing.kinds.CLIENT,
                                          {"server.address": base_url})
        context = span.get_span_context()
        carrier = dict(headers)
        if context.is_valid:
            carrier["traceparent"] = f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"
            if context.trace_state:
                carrier["tracestate"] = context.trace_state.to_header()
        return carrier

    def attempt_done(self, status: int | None, problem: str | None = None) -> None:
        span, self._attempt = self._attempt, None
        if span is None:
            return
        if status is not None:
            span.set_attribute("http.response.status_code", status)
        if problem is not None or (status is not None and status >= 500):
            span.set_attribute("error.type", problem or str(status))
            span.set_status(self.tracing.error(problem or f"HTTP {status}"))
        span.end()

    def first_token(self, ttft_ms: float) -> None:
        self.span.add_event("gen_ai.first_token", {"kilnproxy.ttft_ms": ttft_ms})

    def stream_started(self) -> None:
        self._stream = self.child("kilnproxy.stream")

    def stream_ended(self, disconnected: bool) -> None:
        span, self._stream = self._stream, None
        if span is not None:
            span.set_attribute("kilnproxy.disconnected", disconnected)
            span.end()

    def end(self, row: dict, committed) -> None:
        """The row is submitted: record it on the span, which ends with the row's commit."""
        self.attempt_done(None, "cancelled")
        self.stream_ended(bool(row["disconnected"]))
        span = self.span
        span.set_attributes({
            "gen_ai.response.model": row["model"] or "", "gen_ai.usage.input_tokens": row["prompt_tokens"],
            "gen_ai.usage.output_tokens": row["completion_tokens"], "kilnproxy.cost_usd": row["cost"],
            "http.response.status_code": row["status"], "kilnproxy.disconnected": bool(row["disconnected"])})
        if row["error_code"] is not None:
            span.set_attribute("error.type", row["error_code"])
            if row["status"] >= 500 or row["status"] == 200:  # a server fault, or a stream that ended in one
                span.set_status(self.tracing.error(row["error_code"]))
        commit = self.child("kilnproxy.usage_commit")

        def done(_future) -> None:
            commit.end()
            span.end()

        if committed is None or committed.done():
            done(None)
        else:
            committed.add_done_callback(done)
