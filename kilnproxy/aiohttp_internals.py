"""Every use of aiohttp's private names, in one place: what kilnproxy relies on that aiohttp does not promise.

Written and tested for aiohttp 3.14.4 to 3.14.x (``SUPPORTED``, the range
setup.cfg pins: the suite passes on 3.14.4 and 3.14.5; before 3.14.4 the
parser lets through requests the suite expects refused, such as an asterisk
target on GET). The internals below are older: this module's test and the
response tests also pass on 3.12.0, 3.13.0 and 3.14.0. No other
module of kilnproxy touches an aiohttp private name: they subclass or call
what is here, bound once at import or start-up, so the hot path pays nothing
for it (the response classes below set and read the private attributes
inline, in the methods aiohttp calls per response; a streamed line goes
through ``StreamResponse.write`` unchanged). ``tests/web/test_aiohttp_internals.py``
checks that each internal below still has the shape relied on (it names the
one that changed and the aiohttp installed), and that no other module touches
one. ``RELIED_ON`` lists them for that test.

What is relied on, and what for:

* ``web.StreamResponse`` made without its ``__init__`` (``OneWriteResponse``,
  base of ``kilnproxy.answers.Answer``; ``DictHeadResponse``, base of
  ``kilnproxy.proxy.relay.sse_response.SSEResponse``): ``__init__`` builds a
  ``CIMultiDict`` of headers per response, which these answers build only if
  asked. Relied on: ``__init__`` sets only ``_state`` (the response's mapping
  storage), ``_headers`` (read through the ``headers`` property and
  ``HeadersMixin``: overridden here by a property that builds them when
  asked), ``_status`` and ``_reason`` (read by ``status``, ``reason``; set by
  ``set_status``); every other attribute has a class-level default:
  ``_keep_alive`` (None: not decided), ``_req`` (the request being answered;
  read by ``task`` and ``repr``), ``_payload_writer`` and ``_eof_sent`` (what
  ``prepared``, ``write`` and ``write_eof`` look at), ``_must_be_empty_body``,
  ``_body_length`` (0), ``_compression``, ``_cookies``, ``_chunked`` (False,
  None, False: nobody asked for them), ``_send_headers_immediately`` (True:
  set False to hold the head back for the first body bytes, which the
  request's ``StreamWriter.send_headers`` then sends).
* ``web.AppRunner._make_server`` (``AppRunnerWithServerHook``): the one place
  between the app's start-up (its middlewares final) and the first connection
  where the ``web.Server`` the runner makes can be changed
  (``kilnproxy.web.fastpath`` puts its route table in front of the server's
  ``request_factory`` and ``request_handler``).
* ``web.Application._client_max_size`` (``client_max_size``): the app's body
  limit, for the requests the route table makes itself.
* ``web.Server._loop`` and ``_kwargs`` (``HandlerClassServer``): what
  ``web.Server.__call__`` passes to ``RequestHandler`` for each new
  connection, to make it with a subclass (``kilnproxy.web.parser_errors``);
  and a built ``web.Server``'s ``__class__`` may be swapped for a subclass that
  adds no state (``use_server_class``: aiohttp builds the server itself, in
  ``Application._make_handler``, and gives no way to choose the class).
* ``web.BaseRequest._message`` (``close_after_response``): the parsed
  request, a ``RawRequestMessage`` named tuple whose ``should_close`` the
  request's ``keep_alive`` reads (once, when first read: before a response
  is prepared), and so a response's keep-alive.
* ``web.BaseSite._server`` (``site_sockets``): the site's asyncio ``Server``,
  for its listening sockets (no public way to them).

Not private by name but undocumented, and relied on just the same (checked
by the test, ``ALSO_RELIED_ON``; used where they are): ``StreamWriter.send_headers``,
``enable_chunking``, ``write_headers`` and ``output_size`` (here);
``web.BaseRequest.ATTRS`` (the names a request subclass may set), its
constructor's arguments, and ``web.Server.request_factory`` and
``request_handler`` (``kilnproxy.web.fastpath``); ``RequestHandler.handle_error``'s
arguments (``kilnproxy.web.parser_errors``).
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Mapping, NamedTuple

from aiohttp import web
from aiohttp.helpers import rfc822_formatted_time
from aiohttp.http import SERVER_SOFTWARE, StreamWriter

SUPPORTED = (">=3.14.4", "<3.15")  # the aiohttp versions this module was written and tested for (setup.cfg)


class Internal(NamedTuple):
    """One aiohttp internal kilnproxy relies on: ``name`` on ``owner``, in the shape ``shape``:

    * ``"default"``: a class-level default on ``owner`` equal to ``default`` (``__init__`` is not run);
    * ``"init"``: an instance attribute that ``owner``'s ``__init__`` sets;
    * ``"slot"``: named in ``owner``'s ``__slots__`` (or those of a base);
    * ``"method"``: a method of ``owner`` taking the parameters ``default`` names (self left out);
    * ``"attribute"``: present on ``owner`` (a class attribute, a method or a property)."""

    owner: type
    name: str
    shape: str
    use: str
    default: object = None


_RESPONSE = "kilnproxy.answers.Answer and SSEResponse (made without StreamResponse.__init__)"

RELIED_ON: tuple[Internal, ...] = (
    Internal(web.StreamResponse, "_state", "init", f"{_RESPONSE}: the response's mapping storage"),
    Internal(web.StreamResponse, "_headers", "init", f"{_RESPONSE}: a property that builds the headers when asked"),
    Internal(web.StreamResponse, "_status", "init", f"{_RESPONSE}: the status, read by StreamResponse.status"),
    Internal(web.StreamResponse, "_reason", "init", f"{_RESPONSE}: the reason, set by set_status"),
    Internal(web.StreamResponse, "_keep_alive", "default", f"{_RESPONSE}: the response's keep-alive", None),
    Internal(web.StreamResponse, "_req", "default", f"{_RESPONSE}: the request being answered", None),
    Internal(web.StreamResponse, "_payload_writer", "default", f"{_RESPONSE}: the request's writer, once prepared",
             None),
    Internal(web.StreamResponse, "_eof_sent", "default", f"{_RESPONSE}: the body has ended", False),
    Internal(web.StreamResponse, "_must_be_empty_body", "default", f"{_RESPONSE}: a body may be sent", None),
    Internal(web.StreamResponse, "_body_length", "default", f"{_RESPONSE}: the bytes sent", 0),
    Internal(web.StreamResponse, "_compression", "default", f"{_RESPONSE}: nobody asked for compression", False),
    Internal(web.StreamResponse, "_cookies", "default", f"{_RESPONSE}: nobody set a cookie", None),
    Internal(web.StreamResponse, "_chunked", "default", f"{_RESPONSE}: nobody asked for chunking", False),
    Internal(web.StreamResponse, "_send_headers_immediately", "default",
             f"{_RESPONSE}: a streamed answer's head held back for its first bytes", True),
    Internal(web.AppRunner, "_make_server", "method",
             "AppRunnerWithServerHook (kilnproxy.web.fastpath's route table in front of the server)", ()),
    Internal(web.Application, "_client_max_size", "init",
             "client_max_size (the body limit of kilnproxy.web.fastpath's own requests)"),
    Internal(web.Server, "_loop", "init", "HandlerClassServer (kilnproxy.web.parser_errors' connection handler)"),
    Internal(web.Server, "_kwargs", "init", "HandlerClassServer (kilnproxy.web.parser_errors' connection handler)"),
    Internal(web.BaseRequest, "_message", "init",
             "close_after_response (the shutdown's drain closes each connection after its response)"),
    Internal(web.BaseSite, "_server", "slot", "site_sockets (the listening sockets a rolling restart holds off)"),
)
"""Every aiohttp private name kilnproxy relies on (``tests/web/test_aiohttp_internals.py`` checks each
still has its shape, and that no module but this one touches one)."""

ALSO_RELIED_ON: tuple[Internal, ...] = (
    Internal(StreamWriter, "enable_chunking", "method", "DictHeadResponse (a streamed answer's chunked body)", ()),
    Internal(StreamWriter, "write_headers", "method", "DictHeadResponse (the head from a dict)",
             ("status_line", "headers")),
    Internal(StreamWriter, "send_headers", "method", "DictHeadResponse (a head not held back, sent at once)", ()),
    Internal(StreamWriter, "output_size", "attribute", "OneWriteResponse (its body_length)"),
    Internal(web.BaseRequest, "ATTRS", "attribute", "kilnproxy.web.fastpath.HotRequest (its route attribute)"),
    Internal(web.BaseRequest, "__init__", "method", "kilnproxy.web.fastpath.RouteTable.make_request",
             ("message", "payload", "protocol", "payload_writer", "task", "loop", "client_max_size")),
    Internal(web.Server, "request_factory", "init", "kilnproxy.web.fastpath.FastRunner (its route table)"),
    Internal(web.Server, "request_handler", "init", "kilnproxy.web.fastpath.FastRunner (its route table)"),
    Internal(web.RequestHandler, "handle_error", "method",
             "kilnproxy.web.parser_errors.GatewayRequestHandler (the parser's refusals as JSON)",
             ("request", "status", "exc", "message")),
)
"""Undocumented names, not private, that kilnproxy relies on all the same (the test checks their shape)."""


# -- responses made without StreamResponse.__init__ --------------------------------------------------

_PHRASES = {status.value: status.phrase for status in HTTPStatus}  # aiohttp's REASON_PHRASES


class OneWriteResponse(web.StreamResponse):
    """``web.Response(status=status, body=body, headers={**headers, "Content-Type": content_type})``,
    written in one write of ``self._head(status, body) + body`` when ``self._one_write(request, status)``
    says so, else that ``web.Response`` itself (``kilnproxy.answers.Answer`` says when, and the head).

    ``StreamResponse.__init__`` is not run: its header multidict is built only if asked for."""

    _reason: str | None = None  # set_status() with a reason of its own

    def __init__(self, body: bytes, status: int = 200, content_type: str = "application/json",
                 headers: Mapping[str, str] | None = None):
        self._state = {}
        self._status = status
        self._bytes = body
        self._content_type_value = content_type
        self._extra = headers or {}
        self._fallback: web.Response | None = None
        self._sent = False

    def _one_write(self, request: web.BaseRequest, status: int) -> bool:  # the subclass's
        return False

    def _head(self, status: int, body: bytes) -> bytes:  # the subclass's: what goes before the body
        raise NotImplementedError

    # -- what aiohttp and callers read ---------------------------------------

    @property
    def _headers(self):  # type: ignore[override]
        """The headers as ``web.Response`` has them (rarely asked for). Asked before the answer is
        sent, the answer becomes that ``web.Response``, so that a change to them is sent."""
        if self._fallback is not None:
            return self._fallback.headers
        if self._sent or self._req is not None:
            return self._response().headers
        self._fallback = self._response()
        return self._fallback.headers

    @property
    def reason(self) -> str:
        return _PHRASES.get(self._status, "") if self._reason is None else self._reason

    @property
    def body(self) -> bytes:
        return self._bytes

    @property
    def keep_alive(self) -> bool | None:
        return self._fallback.keep_alive if self._fallback is not None else self._keep_alive

    def force_close(self) -> None:
        self._keep_alive = False
        if self._fallback is not None:
            self._fallback.force_close()

    @property
    def body_length(self) -> int:
        return self._fallback.body_length if self._fallback is not None else self._body_length

    @property
    def prepared(self) -> bool:
        return self._fallback.prepared if self._fallback is not None else self._sent or self._req is not None

    # -- writing --------------------------------------------------------------

    async def prepare(self, request: web.BaseRequest):
        if (self._fallback is None and self._req is None and not self._sent and self._keep_alive is not False
                and self._one_write(request, self._status)):
            self._req = request
            self._keep_alive = True
            return request.writer
        if self._fallback is None:
            self._fallback = self._response()
        return await self._fallback.prepare(request)

    async def write_eof(self, data: bytes = b"") -> None:
        if self._fallback is not None:
            return await self._fallback.write_eof(data)
        if self._sent:
            return
        request = self._req
        assert request is not None, "Response has not been started"
        self._sent = True
        self._req = None
        writer = request.writer
        body = self._bytes
        await writer.write_eof(self._head(self._status, body) + body)
        self._body_length = writer.output_size

    def _response(self) -> web.Response:
        response = web.Response(status=self._status, reason=self._reason, body=self._bytes,
                                headers={**self._extra, "Content-Type": self._content_type_value})
        if self._keep_alive is False:
            response.force_close()
        return response


STATUS_LINE_200 = "HTTP/1.1 200 OK"


class DictHeadResponse(web.StreamResponse):
    """``web.StreamResponse(status=200, headers={**FIRST_HEADERS, **headers})``, chunked, whose head is
    serialised from a plain dict when ``self._usual(request)`` says so and the response is as made
    (200 OK, no keep-alive decided, no compression, cookie nor chunking asked for, its headers not asked
    for); else ``StreamResponse``'s own ``prepare`` on the same headers. With ``hold`` the head waits
    for the first body bytes, to go out with them in one write.

    ``StreamResponse.__init__`` is not run: its header multidict is built only if asked for."""

    FIRST_HEADERS: dict[str, str] = {}  # the subclass's: the head's first headers, before the instance's

    def __init__(self, headers: dict, hold: bool):
        self._state = {}
        self._status, self._reason = 200, "OK"
        self._extra = headers
        self._multidict = None
        self._sent: dict | None = None  # the head's headers, once sent from the dict
        if hold:
            self._send_headers_immediately = False

    def _usual(self, request: web.BaseRequest) -> bool:  # the subclass's: the request and headers allow it
        return False

    def _made_headers(self):  # the subclass's: the CIMultiDict of the head's headers, when asked for
        raise NotImplementedError

    @property
    def held(self) -> bool:
        """The head waits for the first body bytes."""
        return not self._send_headers_immediately

    @property
    def _headers(self):  # type: ignore[override]
        """The headers as ``StreamResponse`` has them (rarely asked for): before ``prepare``, asking
        makes the response ``StreamResponse``'s, so that a change to them is sent."""
        if self._multidict is None:
            self._multidict = self._made_headers()
        return self._multidict

    async def prepare(self, request: web.BaseRequest):
        if (self._payload_writer is None and not self._eof_sent and self._multidict is None
                and self._status == 200 and self._reason == "OK" and self._keep_alive is None
                and not self._compression and not self._cookies and not self._chunked and self._usual(request)):
            writer = self._payload_writer = request.writer
            self._req = request
            self._keep_alive = True
            self._must_be_empty_body = False
            writer.enable_chunking()
            self._sent = {**self.FIRST_HEADERS, **self._extra, "Transfer-Encoding": "chunked",
                          "Date": rfc822_formatted_time(), "Server": SERVER_SOFTWARE}
            await writer.write_headers(STATUS_LINE_200, self._sent)
            if self._send_headers_immediately:
                writer.send_headers()
            return writer
        return await super().prepare(request)


# -- the server: made by aiohttp's runner, changed before it serves -------------------------------------


class AppRunnerWithServerHook(web.AppRunner):
    """``web.AppRunner`` that hands the ``web.Server`` it makes to ``server_made`` first: once, in
    ``setup()``, after the app has started (its middlewares final) and before any connection."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        self.server_made(server)
        return server

    def server_made(self, server: web.Server) -> None:  # the subclass's
        return None


def client_max_size(app: web.Application) -> int:
    """The request body limit ``app`` was made with (``web.Application(client_max_size=...)``)."""
    return app._client_max_size


class HandlerClassServer(web.Server):
    """``web.Server`` whose connections are handled by ``handler_class`` (a ``RequestHandler``
    subclass that adds no state), made with what ``web.Server`` passes its own."""

    handler_class: type = web.RequestHandler

    def __call__(self) -> web.RequestHandler:
        return self.handler_class(self, loop=self._loop, **self._kwargs)


def use_server_class(server: web.Server, server_class: type[HandlerClassServer]) -> None:
    """Make ``server`` (built by aiohttp's runner, before it serves) a ``server_class``: aiohttp builds its
    ``web.Server`` itself (``Application._make_handler``) and gives no way to choose the class."""
    server.__class__ = server_class


# -- a request and a site ---------------------------------------------------------------------------------


def close_after_response(request: web.BaseRequest) -> None:
    """The response will say ``Connection: close``, and aiohttp closes the connection once it is
    sent. (A response left to decide takes keep-alive from the request's parsed message.)"""
    request._message = request._message._replace(should_close=True)


def site_sockets(site: web.BaseSite) -> tuple:
    """``site``'s listening sockets (none before it starts): those of its asyncio ``Server``."""
    return tuple(getattr(getattr(site, "_server", None), "sockets", None) or ())
