"""The request's path: client -> auth & admission -> body rules -> plugins -> upstream -> stream -> client.

* ``gateway``: ``Gateway``, what one running gateway holds, and its app key ``GATEWAY``;
* ``completions``: the completion endpoints' handler, the path in order;
* ``auth``, ``rules``, ``request_body``: the request rules, one function each;
* ``upstream``: balancing, failover and marking down;
* ``stream``, ``relay``, ``usage_chunk``, ``stream_errors``, ``plain_events``: the streamed answer, line by line;
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
