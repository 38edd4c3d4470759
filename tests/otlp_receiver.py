"""A real OTLP/HTTP trace receiver for tests: ``POST /v1/traces`` with a protobuf
``ExportTraceServiceRequest``, decoded with ``opentelemetry-proto`` (``decode``: the gateway writes
the protobuf by hand, the official messages prove it); ``spans`` keeps each span as a plain dict
(ids in hex, attributes as Python values)."""

from __future__ import annotations

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from kilnproxy.web.server import start_app


def _value(any_value):
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


def _attributes(items) -> dict:
    return {kv.key: _value(kv.value) for kv in items}


def decode(body: bytes) -> list[dict]:
    """The spans of one export, each a plain dict (decoded with the official messages)."""
    message = ExportTraceServiceRequest()
    message.ParseFromString(body)
    spans = []
    for resource_spans in message.resource_spans:
        resource = _attributes(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append({
                    "name": span.name, "trace_id": span.trace_id.hex(), "span_id": span.span_id.hex(),
                    "parent_span_id": span.parent_span_id.hex(), "kind": span.kind,
                    "attributes": _attributes(span.attributes), "status": span.status.code,
                    "status_message": span.status.message, "trace_state": span.trace_state,
                    "flags": span.flags, "start": span.start_time_unix_nano, "end": span.end_time_unix_nano,
                    "events": [(e.name, _attributes(e.attributes)) for e in span.events],
                    "service": resource.get("service.name"), "resource": resource, "scope": scope_spans.scope.name})
    return spans


class Receiver:
    def __init__(self):
        self.spans: list[dict] = []
        self.requests: list[dict] = []  # the headers of each export
        self.running = None

    async def start(self) -> "Receiver":
        app = web.Application()
        app.router.add_post("/v1/traces", self.export)
        self.running = await start_app(app, "127.0.0.1", 0)
        return self

    @property
    def url(self) -> str:
        return f"{self.running.url}/v1/traces"

    async def export(self, request: web.Request) -> web.Response:
        assert request.headers["Content-Type"] == "application/x-protobuf"
        self.requests.append(dict(request.headers))
        self.spans.extend(decode(await request.read()))
        return web.Response(body=ExportTraceServiceResponse().SerializeToString(),
                            content_type="application/x-protobuf")

    def named(self, name: str) -> list[dict]:
        return [s for s in self.spans if s["name"] == name]

    async def stop(self) -> None:
        await self.running.stop()
