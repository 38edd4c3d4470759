"""The hot endpoints on aiohttp's low-level server: a route table of our own in front of the app.

``POST /v1/completions`` and ``POST /v1/chat/completions`` (and the other
APIs' ``POST /v1/embeddings``, ``/v1/responses``, ``/v1/messages`` and
``/v1/messages/count_tokens``) are found in a
dict keyed by the request line's method and raw path, and answered from a
plain ``web.BaseRequest``: no URL dispatcher, no ``Request`` with its match
info, no middleware chain rebuilt per request, no ``on_response_prepare``
signal. The app's middlewares (the JSON errors, the shutdown's count of
requests in progress) are composed once, at start-up, around each hot
handler, so a hot request meets exactly the rules any other request does.

Everything else goes to the ordinary ``web.Application`` unchanged: other
paths and methods (so ``GET /v1/completions`` still gets its JSON 405), a
path with a query string or an escape (the app's router decodes it and
routes it to the same handler), and a request with an ``Expect`` header
(the app answers ``100-continue``).

``FastRunner`` is ``web.AppRunner`` with that table put in front of the
app's own request factory and handler.
"""

from __future__ import annotations

import asyncio
from functools import partial
from typing import Awaitable, Callable

from aiohttp import hdrs, web

from ..aiohttp_internals import AppRunnerWithServerHook, client_max_size

Handler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]

# (method, raw path) -> handler: the table ``create_app`` puts in the app for ``FastRunner``
HOT_ROUTES = web.AppKey("hot_routes", dict)


class HotRequest(web.BaseRequest):
    """A request of the route table; ``route`` is its handler, middlewares included."""

    ATTRS = web.BaseRequest.ATTRS | frozenset(["route"])
    route: Handler


class RouteTable:
    def __init__(self, app: web.Application, routes: dict[tuple[str, str], Handler], app_factory, app_handler):
        self._app_factory = app_factory
        self._app_handler = app_handler
        self._max_size = client_max_size(app)
        self._loop = asyncio.get_running_loop()
        self._routes = {key: _with_middlewares(app, handler) for key, handler in routes.items()}

    def make_request(self, message, payload, protocol, writer, task, _cls=HotRequest) -> web.BaseRequest:
        """The server's request factory: a ``HotRequest`` for a route of the table, else the app's."""
        route = self._routes.get((message.method, message.path))
        if route is None or hdrs.EXPECT in message.headers:
            return self._app_factory(message, payload, protocol, writer, task)
        request = _cls(message, payload, protocol, writer, task, self._loop, client_max_size=self._max_size)
        request.route = route
        return request

    def handle(self, request: web.BaseRequest) -> Awaitable[web.StreamResponse]:
        """The server's request handler: the awaitable of the request's own handler (the server awaits
        it; a coroutine of ours around it would only pass its result on)."""
        if type(request) is HotRequest:
            return request.route(request)
        return self._app_handler(request)


def _with_middlewares(app: web.Application, handler: Handler) -> Handler:
    for middleware in reversed(app.middlewares):  # the app's order: the first is the outermost
        handler = partial(middleware, handler=handler)
    return handler


class FastRunner(AppRunnerWithServerHook):
    """``web.AppRunner`` whose server answers ``routes`` ((method, raw path) -> handler) itself."""

    def __init__(self, app: web.Application, routes: dict[tuple[str, str], Handler], **kwargs):
        super().__init__(app, **kwargs)
        self._routes = routes

    def server_made(self, server: web.Server) -> None:
        # in setup(): the app has started and is frozen, its middlewares are final
        table = RouteTable(self.app, self._routes, server.request_factory, server.request_handler)
        server.request_factory, server.request_handler = table.make_request, table.handle
