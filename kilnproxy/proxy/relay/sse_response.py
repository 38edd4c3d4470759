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
from aiohttp.helpers import must_be_empty_body
from aiohttp.http import HttpVersion11
from multidict import CIMultiDict

from ...aiohttp_internals import DictHeadResponse
from ...answers import RESERVED

SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}


class SSEResponse(DictHeadResponse):
    """``web.StreamResponse(status=200, headers={**SSE_HEADERS, **headers})``, made with
    ``SSEResponse(headers, hold)``; with ``hold`` its head waits for the first body bytes, to go out
    with them in one write (``held``). The head from the dict, and what aiohttp reads of a response,
    are ``kilnproxy.aiohttp_internals.DictHeadResponse``'s; here, when and which headers."""

    FIRST_HEADERS = SSE_HEADERS

    def _made_headers(self) -> CIMultiDict:
        return CIMultiDict(self._sent if self._sent is not None else {**SSE_HEADERS, **self._extra})

    def _usual(self, request: web.BaseRequest) -> bool:
        """The request and the headers allow the head from the dict (the response is as made: the caller looked)."""
        if request.version != HttpVersion11 or not request.keep_alive or must_be_empty_body(request.method, 200):
            return False
        for key, value in self._extra.items():
            if type(key) is not str or type(value) is not str or key.lower() in RESERVED:
                return False
        # a plain BaseRequest (the hot routes) sends no signal; a Request, its apps' on_response_prepare
        return not isinstance(request, web.Request) or not any(app.on_response_prepare
                                                               for app in request.match_info.apps)
