"""``SSEResponse``: a streamed answer's response, its head made from a plain dict in the usual exchange.

``web.StreamResponse(status=200, headers=...)`` copies its headers into a
``CIMultiDict`` when it is made, and ``prepare`` runs its header rules on it
(chunking, type, date, server, keep-alive) before serialising it. An
``SSEResponse`` sends the head those rules give in the usual exchange::

    HTTP/1.1 200 OK\\r\\n
    Content-Type: text/event-stream; charset=utf-8\\r\\n
    Cache-Control: no-cache\\r\\n
    X-Accel-Buffering: no\\r\\n
    <the request's headers, in order>\\r\\n
    Transfer-Encoding: chunked\\r\\n
    Date: <this second, aiohttp's>\\r\\n
    Server: <aiohttp's>\\r\\n
    \\r\\n

serialised by the request's writer as aiohttp serialises any head (the same
refusal of a header with a line break), chunked by it, and held back for the
first body bytes or sent at once as ``StreamResponse`` does (``hold``). The
body goes through ``StreamResponse``'s own ``write`` and ``write_eof``.
``tests/proxy/relay/test_stream_response.py`` compares these bytes with ``StreamResponse``'s.

The usual exchange: HTTP/1.1, a connection the response keeps alive (the
request did not ask to close, the shutdown's drain did not mark it, nobody
called ``force_close``), the status left at 200, a method that takes a body with
it (not ``HEAD`` nor ``CONNECT``), headers of str the head's rules leave as they are (none of
``Content-Type``, ``Content-Length``, ``Date``, ``Server``, ``Connection``,
``Transfer-Encoding``, in any case), the headers not asked for before
``prepare`` (a change to them is then sent), no compression nor cookie, and
no ``on_response_prepare`` handler in the request's apps. Anything else is
``StreamResponse``'s own ``prepare`` on the same headers.
"""

from __future__ import annotations

from aiohttp import web
from aiohttp.helpers import must_be_empty_body, rfc822_formatted_time
from aiohttp.http import SERVER_SOFTWARE, HttpVersion11
from multidict import CIMultiDict

from ...answers import RESERVED

SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}
STATUS_LINE = "HTTP/1.1 200 OK"


class SSEResponse(web.StreamResponse):
    """``web.StreamResponse(status=200, headers={**SSE_HEADERS, **headers})``; with ``hold`` its head
    waits for the first body bytes, to go out with them in one write."""

    def __init__(self, headers: dict, hold: bool):
        # StreamResponse.__init__ is not called: its header multidict is built only if asked for
        self._state = {}
        self._status, self._reason = 200, "OK"
        self._extra = headers
        self._multidict: CIMultiDict | None = None
        self._sent: dict | None = None  # the head's headers, once sent from the dict
        if hold:
            self._send_headers_immediately = False

    @property
    def held(self) -> bool:
        """The head waits for the first body bytes."""
        return not self._send_headers_immediately

    @property
    def _headers(self) -> CIMultiDict:  # type: ignore[override]
        """The headers as ``StreamResponse`` has them (rarely asked for): before ``prepare``, asking
        makes the response ``StreamResponse``'s, so that a change to them is sent."""
        if self._multidict is None:
            self._multidict = CIMultiDict(self._sent if self._sent is not None else {**SSE_HEADERS, **self._extra})
        return self._multidict

    async def prepare(self, request: web.BaseRequest):
        if self._payload_writer is None and not self._eof_sent and self._multidict is None and self._usual(request):
            writer = self._payload_writer = request.writer
            self._req = request
            self._keep_alive = True
            self._must_be_empty_body = False
            writer.enable_chunking()
            self._sent = {**SSE_HEADERS, **self._extra, "Transfer-Encoding": "chunked",
                          "Date": rfc822_formatted_time(), "Server": SERVER_SOFTWARE}
            await writer.write_headers(STATUS_LINE, self._sent)
            if self._send_headers_immediately:
                writer.send_headers()
            return writer
        return await super().prepare(request)

    def _usual(self, request: web.BaseRequest) -> bool:
        if (self._status != 200 or self._reason != "OK" or self._keep_alive is not None or self._compression
                or self._cookies or self._chunked or request.version != HttpVersion11 or not request.keep_alive
                or must_be_empty_body(request.method, 200)):
            return False
        for key, value in self._extra.items():
            if type(key) is not str or type(value) is not str or key.lower() in RESERVED:
                return False
        # a plain BaseRequest (the hot routes) sends no signal; a Request, its apps' on_response_prepare
        return not isinstance(request, web.Request) or not any(app.on_response_prepare
                                                               for app in request.match_info.apps)
