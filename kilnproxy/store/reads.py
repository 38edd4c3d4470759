"""The ledger as the commands (``usage``, ``import-ledger``) read it: the SQLite file or PostgreSQL.

Queries are the same text on both stores (``?`` placeholders, SQL both read
the same way); on PostgreSQL they run on one short-lived connection, never
through a gateway. Failures are ``StorageError``: one line, the URL's
password never in it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Iterable
from urllib.parse import urlsplit

from ..errors import StorageError
from .sqlite.schema import read_rows

CONNECT_TIMEOUT = 10.0


async def pg_connect(url: str):
    """One asyncpg connection to ``url``, or a ``StorageError`` saying why not (password hidden)."""
    import asyncpg

    from .postgres.connection import redacted
    try:
        return await asyncpg.connect(url, timeout=CONNECT_TIMEOUT)
    except (OSError, asyncio.TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError, ValueError) as exc:
        raise StorageError(f"cannot connect to PostgreSQL at {redacted(url)}: {reason(exc, url)}"
                           " (check [storage] url, the password and that the server is running)") from None


async def pg_fetch(url: str, sql: str, params: Iterable[Any] = ()) -> list[dict[str, Any]]:
    """The rows of a read query written with ``?`` placeholders, from the database at ``url``."""
    import asyncpg

    from .postgres.connection import numbered, redacted
    conn = await pg_connect(url)
    try:
        return [dict(r) for r in await conn.fetch(numbered(sql), *params)]
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        raise StorageError(f"cannot read the usage rows in {redacted(url)}: {reason(exc, url)}") from None
    finally:
        await pg_close(conn)


async def pg_close(conn) -> None:
    """Close ``conn``; one the server or the network already ended is just dropped."""
    import asyncpg
    try:
        await asyncio.wait_for(conn.close(), 5.0)
    except (OSError, asyncio.TimeoutError, asyncpg.InterfaceError, asyncpg.PostgresError):
        conn.terminate()


def fetch(url: str | None, db: Path, sql: str, params: Iterable[Any] = ()) -> list[dict[str, Any]]:
    """The rows of a read query on PostgreSQL at ``url`` if given, else on the SQLite file ``db``."""
    if url:
        return asyncio.run(pg_fetch(url, sql, list(params)))
    return [dict(r) for r in read_rows(db, sql, params)]


def reason(exc: BaseException, url: str) -> str:
    """The first line of ``exc``'s message, without the password of ``url``."""
    text = (str(exc).strip() or type(exc).__name__).splitlines()[0]
    try:
        password = urlsplit(url).password
    except ValueError:
        password = None
    return text.replace(password, "***") if password else text
