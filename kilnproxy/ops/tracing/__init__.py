"""OpenTelemetry traces of the metered requests (``[tracing]``), written without a dependency.

* ``install``: ``install(app)`` and ``Tracing``, what the request path is handed as ``Gateway.tracer``;
* ``request_trace``: one request's spans, kept while it runs and encoded at its commit;
* ``context``: the client's W3C ``traceparent``/``tracestate``, and the sampling decision;
* ``otlp_wire``: the OTLP trace protobuf, written by hand;
* ``export``: the spans' export, a queue of bounded size, and spans dropped said once a minute.

May import: what ``ops`` may import (``proxy`` and everything below it).
"""
