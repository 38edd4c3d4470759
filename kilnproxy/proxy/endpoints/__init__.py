"""The endpoints: what differs per API, and the routes that reach the request's path.

* ``completions``: POST /v1/completions and /v1/chat/completions (the stream through ``stream_writer``);
* ``embeddings``, ``responses``, ``messages``: POST /v1/embeddings, /v1/responses, /v1/messages and
  /v1/messages/count_tokens, one module per API (their checks, hold, answer's usage; Messages' key
  header, forwarded headers, Anthropic's errors and the unmetered token count);
* ``api_steps``: what those three share (their streams keep their framing through ``framed_writer``;
  usage read from each format's own object);
* ``api_routes``: their routes (the router's, and the server's own table: ``hot_routes``);
* ``embedding_input``: an embeddings request's ``input``, ``encoding_format`` and ``dimensions`` checked;
* ``reads``: the small GET endpoints (catalog, credits, the caller's key, generations, liveness);
* ``json_routes``: what every route shares so nothing is answered outside JSON.

The top of proxy/ (setup.cfg: the ``proxy_layers`` contract): may import the request's path
(``gateway``, ``request_path``, ``forward``, the writers, ...) and everything below it (``relay``,
``upstream``, ``tenancy``, ``request_record``); nothing in proxy/ imports the endpoints. Imported by
the web app.
"""
