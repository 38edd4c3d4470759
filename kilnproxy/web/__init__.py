"""The web app: ``create_app`` (the composition root) and the servers that run it.

* ``app``: builds the aiohttp application: the gateway, its routes, ops and the inspector;
* ``server``: listens on real sockets (the gateway, and the demo's embedded mock);
* ``fastpath``: the hot endpoints on aiohttp's low-level server.

May import: every part below it (ops, inspector, proxy, plugins, store, fixtures, the kernel).
"""
