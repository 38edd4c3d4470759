"""The web app: ``create_app`` (the composition root) and the servers that run it.

* ``app``: builds the aiohttp application: the gateway, its routes, ops and the inspector;
* ``server``: listens on real sockets (the gateway, and the demo's embedded mock);
* ``fastpath``: the hot endpoints on aiohttp's low-level server;
* ``parser_errors``: a request aiohttp's parser refuses is answered as a JSON error, never its text.

May import: every part below it (ops, inspector, proxy, plugins, store, mock_servers, the kernel).
"""
