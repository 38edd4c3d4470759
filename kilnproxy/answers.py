"""``Answer``: a whole non-streamed answer (status, headers, body), written to the client in one write.

``web.Response`` builds a ``CIMultiDict`` of its headers, runs ``prepare``'s
header rules (length, type, date, server, keep-alive), serialises the
headers and writes them with the body. An ``Answer`` holds the same parts and,
in the usual exchange, writes the bytes ``web.Response`` would write,
pre-built in one buffer::

    HTTP/1.1 <status> <reason>\\r\\n
    <headers, in order>\\r\\n
    Content-Type: <type>\\r\\n
    Content-Length: <length of body>\\r\\n
    Date: <this second, cached>\\r\\n
    Server: <aiohttp's>\\r\\n
    \\r\\n
    <body>

through the request's writer (``write_eof``: the writer counts the bytes for
``output_size`` and the access log's ``body_length``, and waits for the
transport to drain as it does for any answer). ``tests/kernel/test_answers.py``
compares these bytes with ``web.Response``'s, header by header.

The usual exchange is: HTTP/1.1, a connection the response keeps alive (so no
``Connection`` header: the request did not ask to close and the shutdown's
drain did not mark it, ``kilnproxy.ops.lifecycle.close_after_response``), a
method and status that carry a body (not ``HEAD``, 1xx, 204, 304), headers
of plain text that aiohttp leaves as they are (none of ``Content-Type``,
``Content-Length``, ``Date``, ``Server``, ``Connection``,
``Transfer-Encoding``), and no ``on_response_prepare`` handler in the request's
apps (the gateway registers none; such a handler may change headers, which a
pre-built buffer would ignore). Anything else is answered by a ``web.Response``
built from the same parts, exactly as before, so its bytes, keep-alive and
``Connection: close`` are aiohttp's own.
"""

from __future__ import annotations

import re
import time

from aiohttp import web
from aiohttp.http import SERVER_SOFTWARE, HttpVersion11

from .aiohttp_internals import OneWriteResponse

# What aiohttp sets or reads itself when it prepares a response: such a header goes to web.Response.
RESERVED = frozenset(("content-type", "content-length", "date", "server", "connection", "transfer-encoding"))
# The characters aiohttp refuses in a header (http_writer's header-injection check).
FORBIDDEN = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
JSON = "application/json"
# What a plugin may not set: the response's framing and type, and the gateway's own id.
GATEWAY_OWNED = RESERVED - {"date", "server"} | frozenset((
    "keep-alive", "proxy-connection", "te", "trailer", "upgrade", "x-neocloud-generation-id"))
HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # RFC 9110's token: what a header's name is

_STATUS_LINES: dict[int, bytes] = {}
_date_second = -1
_date_tail = b""


class Answer(OneWriteResponse):
    """``web.Response(status=status, body=body, headers={**headers, "Content-Type": content_type})``,
    written as one pre-built buffer when the exchange allows it (see the module's docstring). What
    aiohttp reads of a response, and the writing, are ``kilnproxy.aiohttp_internals.OneWriteResponse``'s
    (made with ``Answer(body, status=200, content_type=JSON, headers=None)``); here, when and what."""

    def _one_write(self, request: web.BaseRequest, status: int) -> bool:
        """The usual exchange (the response's keep-alive not turned off: the caller looked)."""
        if (request.version != HttpVersion11 or not request.keep_alive
                or request.method == "HEAD" or status < 200 or status in (204, 304)
                or request.method == "CONNECT" and status < 300):
            return False
        for key, value in self._extra.items():
            if type(key) is not str or type(value) is not str or key.lower() in RESERVED \
                    or not _plain(key) or not _plain(value):
                return False
        if not _plain(self._content_type_value):
            return False
        # a plain BaseRequest (the hot routes) sends no signal; a Request, its apps' on_response_prepare
        return not isinstance(request, web.Request) or not any(app.on_response_prepare
                                                               for app in request.match_info.apps)

    def _head(self, status: int, body: bytes) -> bytes:
        status_line = _STATUS_LINES.get(status)
        if status_line is None:
            status_line = _STATUS_LINES[status] = f"HTTP/1.1 {status} {self.reason}\r\n".encode()
        lines = "".join(f"{key}: {value}\r\n" for key, value in self._extra.items()) if self._extra else ""
        # surrogateescape: a header an upstream sent with bytes that are not UTF-8 goes back as those bytes
        return b"".join((status_line, (f"{lines}Content-Type: {self._content_type_value}\r\n"
                                       f"Content-Length: {len(body)}\r\n").encode("utf-8", "surrogateescape"),
                         date_and_server()))


def header_fault(name: object, value: object) -> str | None:
    """Why a plugin may not send the header ``name: value`` (None when it may): both must be str,
    the name an HTTP token the gateway does not own (any case), the value free of control characters."""
    if type(name) is not str or type(value) is not str:
        return f"header {name!r}: {value!r} is not str to str"
    if not HEADER_NAME.fullmatch(name):
        return f"header name {name!r} is not an HTTP token"
    if name.lower() in GATEWAY_OWNED:
        return f"header {name!r} is the gateway's"
    if not _plain(value):
        return f"header {name!r} has a control character in its value"
    return None


def _plain(text: str) -> bool:
    """No character aiohttp refuses in a header (``isprintable`` first: it is quicker, and stricter)."""
    return text.isprintable() or not FORBIDDEN.search(text)


def date_and_server() -> bytes:
    """``Date`` (this second, computed once a second as aiohttp does), ``Server`` and the blank line."""
    global _date_second, _date_tail
    now = int(time.time())
    if now != _date_second:
        year, month, day, hh, mm, ss, wd, *_ = time.gmtime(now)
        date = "%s, %02d %3s %4d %02d:%02d:%02d GMT" % (_WEEKDAYS[wd], day, _MONTHS[month], year, hh, mm, ss)
        _date_tail = f"Date: {date}\r\nServer: {SERVER_SOFTWARE}\r\n\r\n".encode()
        _date_second = now
    return _date_tail


_WEEKDAYS = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
_MONTHS = ("", "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")
