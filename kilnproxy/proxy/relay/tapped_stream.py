"""A completions stream while the inspector captures it: the same relay and response, each showing its
``Tap`` (``request_observers``) what passes.

``TappedRelay`` hands every upstream chunk to the tap before relaying it, and takes every chunk
through the parser, event by event (no bulk fast path: the capture's reader parses the chunks as
the relay did); ``TappedResponse`` hands the tap every write to the client (events, keep-alives,
the usage chunk, ``[DONE]``). Only a captured request takes them: a stream that is not captured
pays nothing for them.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from ...call import Call
from ...plugins.manager import Impl
from ..request_observers import Tap
from ..request_record import RequestRecord
from .plain_relay import EventRelay, ModelNames


class TappedRelay(EventRelay):
    """``EventRelay`` that shows each chunk of upstream bytes to its tap first."""

    __slots__ = ("tap",)

    def __init__(self, tap: Tap, call: Call, names: ModelNames, record: RequestRecord, impls: tuple[Impl, ...]):
        super().__init__(call, names, record, impls)
        self.tap = tap

    def feed_chunk(self, chunk: bytes) -> bytes:
        """Every chunk through the parser, event by event (no bulk fast path); the tap keeps
        the raw chunk, and the capture's reader parses it as the relay did."""
        self.tap.upstream_chunk(chunk)
        return self.feed(self.parser.feed(chunk))


class TappedResponse(web.StreamResponse):
    """``StreamResponse`` that shows its tap every write (events, keep-alives, ``[DONE]``)."""

    def __init__(self, tap: Tap, **kwargs: Any):
        super().__init__(**kwargs)
        self._tap = tap

    async def write(self, data: bytes) -> None:
        self._tap.client_write(data)
        await super().write(data)

    async def write_eof(self, data: bytes = b"") -> None:
        if data:
            self._tap.client_write(data)
        await super().write_eof(data)
