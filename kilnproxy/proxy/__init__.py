"""The request's path: client -> auth & admission -> body rules -> plugins -> upstream -> stream -> client.

Four folders beside the path's own modules, in the order they may import each other (setup.cfg's
``proxy_layers`` contract, checked by ``lint-imports``):

* ``endpoints/``: what differs per API (completions; embeddings, Responses, Messages), and their routes;
* the request's path, the same for every API:

  * ``gateway``: ``Gateway``, what one running gateway holds, its app key ``GATEWAY``, and the
    protocols of what it is handed from above (``Capture``, ``Tracer``, ``RowObserver``,
    ``CommitListener``);
  * ``request_path``: the request's whole path, in order; ``forward``: its part past admission
    (upstream, then the answer or the stream);
  * ``rules``, ``request_body``: the request rules, one function each (``request_body``: step 3, the body);
  * ``fallbacks``: a model's fallback models, tried in turn; ``discovery``: the models an upstream
    lists (``discover = true``, ``--upstream``);
  * ``stream_writer``, ``framed_writer``: a streamed answer written to the client through a relay
    (the completions' stream; the framed streams of Responses and Messages);

* ``relay/``: the streams' relays, chunk by chunk (which events pass as they came, which are read);
* ``upstream/``: the model servers: routes, slots, the HTTP client and its connections, deadlines,
  responses;
* ``tenancy/``: API keys, the orgs and keys served, and the rules of changing them;
* ``request_record``: ``RequestRecord``, what one request did, turned into its usage row (what every
  part writes to);
* ``request_observers``: what a request's record carries for those who watch it (``Tap``, the
  inspector's capture; ``RequestTrace``, its spans).

Each folder's ``__init__`` names its modules and what it may import. The package may import the
kernel, ``plugins``, ``store`` and ``mock_servers``. It knows nothing of ops, the inspector or the web
app: what they need is handed in (``Gateway.row_observers``, ``commit_listeners``, ``capture``,
``tracer``, ``draining``), typed by the protocols above.
"""
