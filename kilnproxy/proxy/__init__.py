"""The request's path: client -> auth & admission -> body rules -> plugins -> upstream -> stream -> client.

* ``gateway``: ``Gateway``, what one running gateway holds, and its app key ``GATEWAY``;
* ``request_path``: the request's whole path, the same for every API, in order; ``forward``:
  its part past admission (upstream, then the answer or the stream);
* ``completions``, ``apis``: what differs per API (completions; embeddings, the Responses API,
  Anthropic Messages, with ``anthropic_errors`` and ``embedding_input``);
* ``auth``, ``rules``, ``request_body``: the request rules, one function each;
* ``upstream``, ``upstream_slots``, ``deadlines``, ``fallbacks``: balancing, failover and marking
  down, each upstream's slots and queue, first-byte and request deadlines, fallback models;
* ``discovery``: the models an upstream lists (``discover = true``, ``--upstream``);
* ``stream``, ``relay``, ``usage_chunk``, ``stream_errors``, ``plain_events``, ``event_json``: the
  completions' stream, line by line; ``framed_stream``, ``framed_relay``: the streams that keep their
  ``event:`` framing (Responses, Messages);
* ``request_record``: what one request did, turned into its usage row;
* ``read_endpoints``: catalog, credits, the caller's key (``GET /v1/key``), generations, liveness;
* ``tenants``: the config's and the store's orgs and keys, merged in memory for authentication;
* ``tenant_views``, ``tenant_changes``: the org and key objects, and the rules of changing them,
  shared by the admin API (ops) and the ``orgs`` / ``keys`` commands (cli);
* ``json_routes``: what every route shares so nothing is answered outside JSON.

May import: the kernel, ``plugins``, ``store`` and ``fixtures``. Knows nothing
of ops, the inspector or the web app: what they need is handed in
(``Gateway.row_observers``, ``commit_listeners``, ``capture``, ``tracer``, ``draining``).
"""
