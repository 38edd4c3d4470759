"""Operating a gateway: ``/metrics``, ``/admin/*``, the access log, reload, health checks, shutdown.

* ``admin``: the operator's endpoints and the wiring of the rest into the app (``install``);
* ``tenancy_api``: ``/admin/v1``, runtime orgs, keys, credit grants and their audit events;
* ``spend_api``: spend over HTTP, ``/admin/v1/usage`` and the answer of ``/v1/org/usage``;
* ``org_api``: ``/v1/org``, the same for an org's own admin keys, scoped to their org;
* ``metrics``, ``accesslog``: what the gateway is doing, for Prometheus and as JSON lines;
* ``batch_metrics``: the Batch API's lines by outcome and the batch queue's depth, for Prometheus;
* ``reload``: the config re-read without a restart (SIGHUP, ``POST /admin/reload``);
* ``health``: active checks of the upstreams;
* ``load_poll``: the upstream servers' own loads, read in the background and bound to their slots (``load_poll``);
* ``lifecycle``: signals, the drain and graceful shutdown;
* ``tracing``: OpenTelemetry spans of the metered requests (``[tracing]``, handed in as ``Gateway.tracer``).

May import: ``batches``, ``proxy`` and everything below them; not the inspector, the web app or the CLI.
"""
