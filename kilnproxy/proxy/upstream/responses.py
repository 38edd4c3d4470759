"""One upstream answer as the relays read it: status, headers, and the body as it arrives.

``UpstreamResponse`` is filled by its connection (``upstream_connections``)
from ``data_received`` and read by one task. It offers the part of aiohttp's
``ClientResponse`` the gateway uses, with ``content`` being the response
itself: ``readany()`` (every byte buffered so far, ``b""`` once the body has
ended), ``read()`` (the whole body), ``is_eof()`` (the upstream sent its whole
body), ``at_eof()`` (and all of it was read), ``set_exception()`` (every later
read raises it: a deadline, a shutdown), ``release()`` and ``close()``.

Flow control: past ``HIGH_WATER`` unread bytes the connection stops reading
from the socket (the model server's writes then block), and reads again once
the reader has taken them. A read waits at most the idle timeout for bytes and
then raises ``TimeoutError``.

The connection goes back to its pool as soon as the whole message has arrived
with keep-alive; from then on the response only holds its buffered bytes.
``release()`` and ``close()`` of a response whose body did not end hang up, so
that the model server stops generating; both are safe to call more than once.
"""

from __future__ import annotations

import asyncio

from multidict import CIMultiDictProxy

HIGH_WATER = 1 << 16  # unread bytes before the upstream socket is no longer read


class UpstreamResponse:
    """The answer to one request; see the module's docstring for the contract."""

    __slots__ = ("status", "headers", "connection", "_loop", "_idle", "_chunks", "_size", "_waiter", "_done",
                 "_exc", "_broken", "_paused", "__weakref__")

    def __init__(self, connection, loop: asyncio.AbstractEventLoop, idle: float):
        self.status = 0
        self.headers: CIMultiDictProxy[str] | None = None
        self.connection = connection  # None once the message is complete or the connection is closed
        self._loop = loop
        self._idle = idle
        self._chunks: list[bytes] = []
        self._size = 0
        self._waiter: asyncio.Future | None = None
        self._done = False  # the whole body arrived
        self._exc: BaseException | None = None  # set from outside: raised before any buffered byte
        self._broken: BaseException | None = None  # the connection failed: raised after the buffered bytes
        self._paused = False

    @property
    def content(self) -> "UpstreamResponse":
        """The body reader (aiohttp's ``resp.content``): the response itself."""
        return self

    # -- reading (the relay's task) ---------------------------------------------

    async def readany(self) -> bytes:
        while True:
            if self._exc is not None:
                raise self._exc
            if self._chunks:
                return self._take()
            if self._done:
                return b""
            if self._broken is not None:
                raise self._broken
            await self._wait()

    async def read(self) -> bytes:
        if self._done and self._exc is None:  # the whole body is here (a short answer came with its head)
            return self._take() if self._chunks else b""
        parts = []
        while chunk := await self.readany():
            parts.append(chunk)
        return b"".join(parts)

    def is_eof(self) -> bool:
        return self._done

    def has_data(self) -> bool:
        """Some of the body is here, unread (a read would not wait)."""
        return bool(self._chunks)

    def at_eof(self) -> bool:
        return self._done and not self._chunks

    def set_exception(self, exc: BaseException) -> None:
        self._exc = exc
        self._wake()

    async def wait_headers(self) -> None:
        """Until the status line and headers have arrived (raises what broke the connection)."""
        while self.headers is None:
            if self._exc is not None:
                raise self._exc
            if self._broken is not None:
                raise self._broken
            await self._wait()

    def _take(self) -> bytes:
        chunks = self._chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._size = 0
        if self._paused:
            self._paused = False
            if self.connection is not None and not self.connection.closed:
                self.connection.transport.resume_reading()
        return data

    async def _wait(self) -> None:
        loop = self._loop
        waiter = self._waiter = loop.create_future()
        timer = loop.call_at(loop.time() + self._idle, _idle_passed, waiter)  # call_later's own work, in line
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- ending -------------------------------------------------------------------

    def release(self) -> None:
        """Done with the response: a complete one's connection is in the pool already; else hang up."""
        self.close()

    def close(self) -> None:
        """Hang up unless the whole message arrived (its connection then serves the next request)."""
        connection = self.connection
        self._chunks.clear()
        if connection is not None:
            self.connection = None
            connection.hang_up()

    # -- filled by the connection (from data_received / connection_lost) -------

    def headers_arrived(self, status: int, headers: CIMultiDictProxy[str]) -> None:
        self.status = status
        self.headers = headers
        self._wake()

    def body_arrived(self, data: bytes) -> None:
        self._chunks.append(data)
        self._size += len(data)
        if self._size > HIGH_WATER and not self._paused and self.connection is not None \
                and not self.connection.closed:
            self._paused = True
            self.connection.transport.pause_reading()
        self._wake()

    def ended(self) -> None:
        """The whole message arrived; the connection is no longer this response's."""
        self._done = True
        if self._paused:  # the connection may serve the next request: it must read again
            self._paused = False
            if not self.connection.closed:
                self.connection.transport.resume_reading()
        self.connection = None
        self._wake()

    def broke(self, exc: BaseException) -> None:
        """The connection failed before the message ended."""
        self.connection = None
        if self._broken is None:
            self._broken = exc
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


def _idle_passed(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())
