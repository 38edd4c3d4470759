"""Step 3 of the request rules (docs/reference.md): the request body, read, decoded and parsed, or a 4xx JSON error.
``read_body`` is the reading and decoding alone, which the admin API's bodies share.

* Not all there within ``request_body_timeout`` seconds (a client that
  announces more than it sends, or trickles it) -> 408 ``request_timeout``.
* Larger than ``max_request_bytes`` -> 413 ``request_too_large``. The limit
  applies to the body as sent and, for a compressed body, to the decoded body
  too: decoding stops at the limit, so a small body cannot expand without bound.
* ``Content-Encoding``: none, ``identity``, ``gzip`` (``x-gzip``) or ``deflate``
  (zlib, or the raw deflate some clients send) are decoded here. Any other
  encoding, or several, -> 415 ``unsupported_content_encoding``; a body that
  does not decode -> 400 ``invalid_request``. The servers of ``kilnproxy.web.server``
  run with aiohttp's ``auto_decompress`` off, so the bytes read here are the
  client's own.
* Not JSON, not an object, no string ``model`` -> 400 ``invalid_request``, and
  so is JSON nested deeper than ``MAX_DEPTH``, which could not be serialized
  again for the upstream. JSON is read as Python's json module reads it: by
  orjson, and by the json module only where orjson refuses (``event_json``), so
  that a string escaping a lone surrogate (half an emoji an answer ended with,
  sent back in a chat's next turn) is read; it is written upstream with the
  escape as sent. So is a body that begins with a UTF-8 byte order mark (sent
  on without it), and one with an integer beyond 64 bits, which orjson reads
  as a float: the json module reads it whole, and it goes upstream as sent.
  A usual body orjson reads never reaches the json module.
"""

from __future__ import annotations

import asyncio
import zlib
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from ..config import ServerConfig
from ..errors import GatewayError, bad_request
from .relay.event_json import exact_integers, read_stdlib

# orjson reads up to 1024 levels of arrays and objects but writes at most 254. Real bodies (JSON
# schemas included) stay far below 128, which leaves room for what wraps a body (plugins, the
# inspector's capture) before it is written again.
MAX_DEPTH = 128
BOM = b"\xef\xbb\xbf"
ENCODINGS = {"gzip": zlib.MAX_WBITS | 16, "x-gzip": zlib.MAX_WBITS | 16, "deflate": zlib.MAX_WBITS}


async def read_json_body(request: web.Request, server: ServerConfig) -> dict[str, Any]:
    """The body as a JSON object with a string ``model``, or the ``GatewayError`` that refuses it."""
    raw = await read_body(request, server)
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        body = _refused_by_orjson(raw, exc)
    else:
        body = exact_integers(raw, body)  # vLLM's Python reads an integer beyond 64 bits whole: so is it sent on
    if not isinstance(body, dict):
        raise bad_request(f"The request body must be a JSON object, not {type(body).__name__}.")
    if raw.count(b"[") + raw.count(b"{") > MAX_DEPTH:  # enough brackets to be too deep: look closer
        _check_depth(body)
    if "model" not in body:
        raise bad_request("The request body has no `model`.", param="model")
    if not isinstance(body["model"], str):
        raise bad_request("`model` must be a string.", param="model")
    return body


def _refused_by_orjson(raw: bytes, exc: orjson.JSONDecodeError) -> Any:
    """What orjson refuses that the json module reads: a string escaping a lone surrogate, and a UTF-8
    byte order mark before the JSON (vLLM's Python reads bytes so, llama.cpp's JSON reader skips it too;
    it is not written upstream). Anything else: 400."""
    if raw.startswith(BOM):
        raw = raw[len(BOM):]
        try:
            return exact_integers(raw, orjson.loads(raw))
        except orjson.JSONDecodeError as inner:
            exc = inner
    if b"\\u" not in raw:  # orjson refuses only the escape of a lone surrogate that the json module reads
        raise bad_request(f"The request body is not valid JSON: {exc}") from None
    try:
        return read_stdlib(raw)
    except ValueError:
        raise bad_request(f"The request body is not valid JSON: {exc}") from None


async def read_body(request: web.Request, server: ServerConfig) -> bytes:
    """The body's bytes, decoded from its ``Content-Encoding``, or the 408, 413, 415 or 400
    ``GatewayError`` that refuses it (the rules above; nothing about JSON)."""
    max_bytes = server.max_request_bytes
    headers = request.headers
    if "Content-Encoding" not in headers:  # the usual body
        encoding = ""
    else:
        encoding = ", ".join(headers.getall("Content-Encoding")).strip().lower()  # two lines: a list
        if encoding not in ENCODINGS and encoding not in ("", "identity"):
            raise GatewayError(415, "unsupported_content_encoding",
                               f"Content-Encoding {encoding!r} is not supported; send the body as it is, "
                               "or compressed with gzip or deflate.")
    if request.content.is_eof():  # the whole body came with the headers (most do): nothing to wait for
        raw = _arrived(request, max_bytes)
    else:
        try:
            async with asyncio.timeout(server.request_body_timeout):
                raw = await _read(request, max_bytes)
        except TimeoutError:
            raise GatewayError(408, "request_timeout", f"The request body did not arrive within "
                               f"{server.request_body_timeout:g} s (server.request_body_timeout).") from None
    if encoding in ENCODINGS:
        raw = _decoded(raw, encoding, max_bytes)
    return raw


def _arrived(request: web.Request, max_bytes: int) -> bytes:
    """The body, all of it already read from the socket: the same checks as ``_read``'s."""
    length = request.content_length
    if length is not None and length > max_bytes:
        raise too_large(max_bytes)
    try:
        raw = request.content.read_nowait()
    except (aiohttp.ClientPayloadError, web.RequestPayloadError, ValueError):
        raise bad_request("The request body ended before its Content-Length.") from None
    if len(raw) > max_bytes:
        raise too_large(max_bytes)
    if length is not None and len(raw) != length:
        raise bad_request("The request body ended before its Content-Length.")
    return raw


async def _read(request: web.Request, max_bytes: int) -> bytes:
    length = request.content_length
    if length is not None and length > max_bytes:
        raise too_large(max_bytes)
    try:
        if length is not None:
            return await request.content.readexactly(length)
        parts: list[bytes] = []
        size = 0
        async for chunk in request.content.iter_any():
            size += len(chunk)
            if size > max_bytes:
                raise too_large(max_bytes)
            parts.append(chunk)
        return b"".join(parts)
    except (asyncio.IncompleteReadError, aiohttp.ClientPayloadError, web.RequestPayloadError, ValueError):
        raise bad_request("The request body ended before its Content-Length.") from None


def _decoded(raw: bytes, encoding: str, max_bytes: int) -> bytes:
    try:
        return inflate(raw, encoding, max_bytes)
    except TooLarge:
        raise too_large(max_bytes) from None
    except ValueError as exc:
        raise bad_request(f"The request body is {exc}.") from None


class TooLarge(ValueError):
    pass


def inflate(raw: bytes, encoding: str, max_bytes: int) -> bytes:
    """``raw`` decoded from ``encoding`` (one of ``ENCODINGS``); ``TooLarge`` beyond ``max_bytes``,
    ``ValueError`` saying what it is when it is not one whole stream of that encoding."""
    wbits = ENCODINGS[encoding]
    if encoding == "deflate" and not _zlib_header(raw):
        wbits = -zlib.MAX_WBITS  # raw deflate, without the zlib wrapper HTTP asks for
    decoder = zlib.decompressobj(wbits)
    try:
        out = decoder.decompress(raw, max_bytes + 1)
    except zlib.error:
        raise ValueError(f"not valid {encoding} data") from None
    if len(out) > max_bytes:
        raise TooLarge(f"more than {max_bytes} bytes once decoded")
    if not decoder.eof or decoder.unused_data:
        raise ValueError(f"not one complete {encoding} stream")
    return out


def _zlib_header(raw: bytes) -> bool:
    return len(raw) >= 2 and raw[0] & 0x0F == 8 and (raw[0] << 8 | raw[1]) % 31 == 0


def _check_depth(body: Any) -> None:
    """400 when arrays and objects nest deeper than ``MAX_DEPTH`` (iterative: no recursion limit)."""
    stack = [(body, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise bad_request(f"The request body nests arrays and objects deeper than {MAX_DEPTH} levels.")
        children = item.values() if isinstance(item, dict) else item
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))


def too_large(max_bytes: int) -> GatewayError:
    return GatewayError(413, "request_too_large",
                        f"The request body is larger than {max_bytes} bytes (server.max_request_bytes).")
