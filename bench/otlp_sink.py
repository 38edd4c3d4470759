"""A local OTLP/HTTP trace receiver for the tracing variant of M1 and M2: ``POST /v1/traces`` answers
200 with an empty ``ExportTraceServiceResponse`` (what a collector answers when it takes every span);
the spans are counted, not kept. ``GET /stats``: ``{"exports", "spans", "bytes"}`` so far.

    python bench/otlp_sink.py --port 4318
"""

from __future__ import annotations

import argparse

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
)

STATS = web.AppKey("stats", dict)


async def export(request: web.Request) -> web.Response:
    body = await request.read()
    message = ExportTraceServiceRequest()
    message.ParseFromString(body)
    stats = request.app[STATS]
    stats["exports"] += 1
    stats["bytes"] += len(body)
    stats["spans"] += sum(len(scope.spans) for rs in message.resource_spans for scope in rs.scope_spans)
    return web.Response(body=b"", content_type="application/x-protobuf")  # an empty response message


async def stats(request: web.Request) -> web.Response:
    return web.json_response(request.app[STATS])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[STATS] = {"exports": 0, "spans": 0, "bytes": 0}
    app.router.add_post("/v1/traces", export)
    app.router.add_get("/stats", stats)
    web.run_app(app, host="127.0.0.1", port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
