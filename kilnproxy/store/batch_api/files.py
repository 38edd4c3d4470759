"""``FileStore``: the Batch API's files, written and read in chunks, each its org's.

A file's bytes are rows of ``kiln_file_chunks`` of at most ``CHUNK_BYTES`` each: an upload is
written as it arrives and a download read one chunk at a time, so a file of 100 MiB is never held
whole in memory, and every replica on PostgreSQL reads what another wrote. A file is listed and
read only once ``complete``: an upload cut short, refused or over its bound leaves nothing (its
chunks are deleted), and one whose process died is swept later (``sweep``).

``org`` None in a read means any org (the runner's reads; the API always passes the key's org).
"""

from __future__ import annotations

import os
import time
from typing import Any, AsyncIterator

CHUNK_BYTES = 1024 * 1024
FILE_COLUMNS = "id, org, purpose, filename, bytes, created_at"
UPLOAD_SWEEP_SECONDS = 24 * 3600  # an upload still incomplete after this was cut by a process that died


def new_file_id() -> str:
    """``file-`` + the time in ms (12 hex digits) + 48 random bits: newer ids sort after older ones."""
    return f"file-{int(time.time() * 1000):012x}{os.urandom(6).hex()}"


class FileStore:
    def __init__(self, db: Any):
        self.db = db

    async def begin(self, org: str, purpose: str, filename: str, file_id: str | None = None) -> str:
        """A new file, not complete yet: its chunks follow (``append``), then ``finish`` or ``discard``."""
        file_id = file_id or new_file_id()
        async with self.db.transaction() as tx:
            await tx.fetch("INSERT INTO kiln_files (id, org, purpose, filename, bytes, created_at, complete)"
                           " VALUES (?, ?, ?, ?, 0, ?, 0)", file_id, org, purpose, filename, int(time.time()))
        return file_id

    async def append(self, file_id: str, seq: int, data: bytes) -> None:
        async with self.db.transaction() as tx:
            await tx.fetch("INSERT INTO kiln_file_chunks (file_id, seq, data) VALUES (?, ?, ?)", file_id, seq, data)

    async def finish(self, file_id: str, size: int) -> None:
        async with self.db.transaction() as tx:
            await tx.fetch("UPDATE kiln_files SET bytes = ?, complete = 1 WHERE id = ?", size, file_id)

    async def discard(self, file_id: str) -> None:
        """The file and its chunks, gone (an upload refused or cut short)."""
        async with self.db.transaction() as tx:
            await _delete(tx, file_id)

    async def get(self, org: str | None, file_id: str) -> dict[str, Any] | None:
        row = await self.db.fetchrow(f"SELECT {FILE_COLUMNS} FROM kiln_files WHERE id = ? AND complete = 1",
                                     file_id)
        if row is None or (org is not None and row["org"] != org):
            return None
        return row

    async def list(self, org: str, limit: int, after: str | None) -> list[dict[str, Any]]:
        """The org's complete files, newest first, ``limit`` of them, those older than ``after``."""
        sql = f"SELECT {FILE_COLUMNS} FROM kiln_files WHERE org = ? AND complete = 1"
        args: list[Any] = [org]
        if after is not None:
            sql += " AND id < ?"
            args.append(after)
        return await self.db.fetch(sql + " ORDER BY id DESC LIMIT ?", *args, limit)

    async def delete(self, org: str, file_id: str) -> bool:
        """Delete the org's file; False when it has none of that id."""
        async with self.db.transaction() as tx:
            row = await tx.fetchrow("SELECT org FROM kiln_files WHERE id = ? AND complete = 1", file_id)
            if row is None or row["org"] != org:
                return False
            await _delete(tx, file_id)
            return True

    async def chunks(self, file_id: str) -> AsyncIterator[bytes]:
        """The file's bytes, chunk by chunk (one query each: only one chunk is held at a time)."""
        seq = 0
        while True:
            data = await self.db.fetchval("SELECT data FROM kiln_file_chunks WHERE file_id = ? AND seq = ?",
                                          file_id, seq)
            if data is None:
                return
            yield bytes(data)
            seq += 1

    async def lines(self, file_id: str) -> AsyncIterator[bytes]:
        """The file's lines without their line ends (a last line without one included), read chunk by chunk;
        a line longer than a chunk is held whole while it is read."""
        rest = b""
        async for chunk in self.chunks(file_id):
            parts = (rest + chunk).split(b"\n")
            rest = parts.pop()
            for part in parts:
                yield part.rstrip(b"\r")
        if rest:
            yield rest.rstrip(b"\r")

    async def write(self, org: str, purpose: str, filename: str, pieces: Any) -> tuple[str, int]:
        """A new file of ``pieces`` (an async iterator of bytes), ``CHUNK_BYTES`` a chunk, left not complete
        (whoever wrote it completes it, ``BatchStore.conclude``); its id and size."""
        file_id = await self.begin(org, purpose, filename)
        seq = size = 0
        buffer = bytearray()
        async for piece in pieces:
            buffer += piece
            size += len(piece)
            while len(buffer) >= CHUNK_BYTES:
                await self.append(file_id, seq, bytes(buffer[:CHUNK_BYTES]))
                del buffer[:CHUNK_BYTES]
                seq += 1
        if buffer:
            await self.append(file_id, seq, bytes(buffer))
        return file_id, size

    async def sweep(self) -> None:
        """Delete the uploads left incomplete for ``UPLOAD_SWEEP_SECONDS`` (their process died)."""
        old = await self.db.fetch("SELECT id FROM kiln_files WHERE complete = 0 AND created_at < ?",
                                  int(time.time() - UPLOAD_SWEEP_SECONDS))
        for row in old:
            await self.discard(row["id"])


async def _delete(tx: Any, file_id: str) -> None:
    await tx.fetch("DELETE FROM kiln_file_chunks WHERE file_id = ?", file_id)
    await tx.fetch("DELETE FROM kiln_files WHERE id = ?", file_id)
