"""Operating a gateway: ``/metrics``, ``/admin/*``, the access log, reload, health checks, shutdown.

* ``admin``: the operator's endpoints and the wiring of the rest into the app (``install``);
* ``tenancy_api``: ``/admin/v1``, runtime orgs, keys, credit grants and their audit events;
* ``metrics``, ``accesslog``: what the gateway is doing, for Prometheus and as JSON lines;
* ``reload``: the config re-read without a restart (SIGHUP, ``POST /admin/reload``);
* ``health``: active checks of the upstreams;
* ``lifecycle``: signals, the drain and graceful shutdown;
* ``tracing``: OpenTelemetry spans of the metered requests (``[tracing]``, handed in as ``Gateway.tracer``);
* ``request_trace``: one request's spans, kept while it runs and encoded at its commit;
* ``trace_context``: the client's W3C ``traceparent``/``tracestate``, and the sampling decision;
* ``otlp_wire``: the OTLP trace protobuf, written by hand (tracing needs no package);
* ``trace_export``: their export, a queue of bounded size, and spans dropped said once a minute.

May import: ``proxy`` and everything below it; not the inspector, the web app or the CLI.
"""
