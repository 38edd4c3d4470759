"""Byte-level SSE parsing and framing, for upstream streams of any line length.

aiohttp's ``readline()`` refuses lines over a few hundred KiB, so the relay
reads raw chunks and feeds them here. ``SSEParser.feed(chunk)`` returns the
complete items that chunk finished, as ``(kind, payload)`` pairs:

* ``(DATA, payload)``: one event's data (its ``data:`` lines joined with LF,
  one leading space stripped, as the SSE standard and openai-python do);
* ``(COMMENT, line)``: a comment line (starting with ``:``), to pass through.

CR, LF and CRLF all end a line, also when a CRLF is split across two reads.
``event:``, ``id:``, ``retry:`` and unknown fields are dropped: our output
never carries them (they break the openai SDK's decoder).
"""

from __future__ import annotations

DATA = 0
COMMENT = 1

DONE = b"[DONE]"
DONE_FRAME = b"data: [DONE]\n\n"
KEEPALIVE_FRAME = b": keepalive\n\n"


def data_frame(payload: bytes) -> bytes:
    """The event of a one-line ``payload`` (see ``lines_frame``)."""
    return b"data: " + payload + b"\n\n"


def lines_frame(frame: bytes) -> bytes:
    """``frame`` (``data_frame``'s) with a ``data:`` line per line of its payload: an upstream event of
    several ``data:`` lines, whose payload the parser joined with LF, goes out as several lines again."""
    return frame[:-2].replace(b"\n", b"\ndata: ") + b"\n\n"


def is_done(payload: bytes) -> bool:
    """``[DONE]``, trailing spaces included, as openai-python reads it (``startswith``)."""
    return payload[:6] == DONE


class SSEParser:
    __slots__ = ("_parts", "_cr", "_data")

    def __init__(self) -> None:
        self._parts: list[bytes] = []  # an unfinished line, in pieces (no quadratic joins)
        self._cr = False  # the last chunk ended in CR: a leading LF of the next is its pair
        self._data: list[bytes] | None = None  # data lines of the event being read

    def feed(self, chunk: bytes) -> list[tuple[int, bytes]]:
        if self._cr:
            self._cr = False
            if chunk[:1] == b"\n":
                chunk = chunk[1:]
        if b"\r" in chunk:
            self._cr = chunk[-1:] == b"\r"
            chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        if b"\n" not in chunk:
            if chunk:
                self._parts.append(chunk)
            return []
        if self._parts:
            self._parts.append(chunk)
            chunk = b"".join(self._parts)
            self._parts = []
        lines = chunk.split(b"\n")
        rest = lines.pop()
        if rest:
            self._parts.append(rest)
        out: list[tuple[int, bytes]] = []
        for line in lines:
            self._line(line, out)
        return out

    def idle(self) -> bool:
        """Nothing pending: the next byte starts a new line and a new event."""
        return not self._parts and self._data is None and not self._cr

    def close(self) -> list[tuple[int, bytes]]:
        """End of stream: a last event not closed by a blank line still counts."""
        out: list[tuple[int, bytes]] = []
        if self._parts:
            self._line(b"".join(self._parts), out)
            self._parts = []
        self._line(b"", out)
        return out

    def _line(self, line: bytes, out: list) -> None:
        if not line:
            if self._data is not None:
                data = self._data
                self._data = None
                out.append((DATA, data[0] if len(data) == 1 else b"\n".join(data)))
            return
        if line[:5] == b"data:":
            value = line[6:] if line[5:6] == b" " else line[5:]
            if self._data is None:
                self._data = [value]
            else:
                self._data.append(value)
        elif line[:1] == b":":
            out.append((COMMENT, line))
        # event:, id:, retry: and unknown fields are dropped on purpose.
