"""Raw HTTP/1.1 exchanges with a server, and a comparison of two answers byte for byte (their ``Date``
lines only by shape): for tests that pin a hand-built answer to the one aiohttp would have written."""

from __future__ import annotations

import asyncio
import re

DATE = re.compile(rb"^Date: (Mon|Tue|Wed|Thu|Fri|Sat|Sun), \d\d (Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec) "
                  rb"\d{4} \d\d:\d\d:\d\d GMT$")


async def read_one(reader: asyncio.StreamReader, head_only: bool) -> bytes:
    """One answer's bytes: its head, then its body as its head frames it (chunked, a length, the close)."""
    head = await reader.readuntil(b"\r\n\r\n")
    if head_only:
        return head
    if b"\r\nTransfer-Encoding: chunked\r\n" in head:
        return head + await reader.readuntil(b"\r\n0\r\n\r\n")
    length = re.search(rb"\r\nContent-Length: (\d+)\r\n", head)
    if length:
        return head + await reader.readexactly(int(length.group(1)))
    return head + await reader.read()  # to the close


async def exchange(port: int, *requests: bytes, probe: bytes) -> tuple[list[bytes], bool]:
    """Each request on one connection; the answers, and whether the server closed it after the last
    (``probe``, sent last, is answered only on a connection kept alive)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    out = []
    try:
        async with asyncio.timeout(30):  # only stops a test that would hang
            for data in requests:
                writer.write(data)
                out.append(await read_one(reader, data.startswith(b"HEAD ")))
            writer.write(probe)
            try:
                await read_one(reader, False)
                closed = False
            except (asyncio.IncompleteReadError, ConnectionResetError):
                closed = True
    finally:
        writer.close()
    return out, closed


def assert_same(got: bytes, want: bytes) -> None:
    """``got`` is ``want`` byte for byte, but for a ``Date`` line, which need only be one."""
    got_head, _, got_body = got.partition(b"\r\n\r\n")
    want_head, _, want_body = want.partition(b"\r\n\r\n")
    got_lines, want_lines = got_head.split(b"\r\n"), want_head.split(b"\r\n")
    assert len(got_lines) == len(want_lines), (got_lines, want_lines)
    for mine, theirs in zip(got_lines, want_lines):
        if theirs.startswith(b"Date: ") and theirs != b"Date: yesterday":
            assert DATE.match(mine) and DATE.match(theirs), (mine, theirs)
        else:
            assert mine == theirs
    assert got_body == want_body
