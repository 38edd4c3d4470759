"""The answer to a request aiohttp's parser refuses: the gateway's JSON error, not aiohttp's text.

aiohttp answers a request it cannot parse (a header line without a colon, a
bare ``\\n`` line, a bad method token, a line over 8 KiB) itself, before any
handler or middleware, through ``RequestHandler.handle_error`` on a
placeholder request whose path is ``/``: a ``text/plain`` 400 that quotes the
offending bytes back. ``GatewayServer`` makes the connections' handlers
``GatewayRequestHandler``, whose ``handle_error`` answers such a request with
the gateway's own error shape instead, code ``malformed_http``, and the
inspector page's security headers (the real path is unknown: it may have been
under ``/ui``), and closes the connection (the parser cannot find where the
next request starts). The log line is aiohttp's, made one line by the
gateway's log filter (``kilnproxy.web.server``). Any other error
(``handle_error`` for a handler's 500 or 504) is aiohttp's, unchanged.

Nothing here runs on an ordinary request: the handler class is chosen once
per connection.
"""

from __future__ import annotations

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler

from ..aiohttp_internals import HandlerClassServer, use_server_class
from ..errors import bad_request, error_json
from ..inspector import fallback_headers

MALFORMED_MESSAGE = "The request is not valid HTTP/1.1; it was not read."
# The headers of every such answer: those of an error under /ui, and the connection's end.
HEADERS = {**(fallback_headers("/ui") or {}), "Connection": "close"}
BODY = error_json(bad_request(MALFORMED_MESSAGE, code="malformed_http").payload())


class GatewayRequestHandler(RequestHandler):
    """aiohttp's connection handler, with the parser's refusals answered as ``malformed_http``."""

    __slots__ = ()  # as aiohttp's: no instance dict on every connection

    def handle_error(self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        answer = super().handle_error(request, status, exc, message)  # logs it; raises if an answer had begun
        if not isinstance(exc, HttpProcessingError):
            return answer
        response = web.Response(status=400, body=BODY, content_type="application/json", headers=HEADERS)
        response.force_close()
        return response


class GatewayServer(HandlerClassServer):
    """``web.Server`` whose connections are handled by ``GatewayRequestHandler``."""

    handler_class = GatewayRequestHandler


def answer_malformed_requests(server: web.Server) -> None:
    """Make ``server`` (built by aiohttp's runner, before it serves) a ``GatewayServer``. aiohttp builds
    its ``web.Server`` itself (``Application._make_handler``) and gives no way to choose the class."""
    use_server_class(server, GatewayServer)
