"""The PostgreSQL store's connections: their bounds, what a database out of reach raises, the URL shown.

Every statement is bounded on both sides: PostgreSQL ends one that waits for a
lock past ``LOCK_TIMEOUT`` or runs past ``SERVER_STATEMENT_TIMEOUT`` (the
session's settings, ``session_settings``), before the client gives up at
``STATEMENT_TIMEOUT``. A statement the client gave up on would otherwise go on
in the server, its locks held. ``down_error`` tells a store that cannot take
statements now from a batch that failed; ``redacted`` and ``reason`` keep the
password out of messages; ``numbered`` turns ``?`` placeholders into ``$n``.
"""

from __future__ import annotations

import asyncio
import logging
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from .sqlstates import database_state

class OneLine(logging.Filter):
    """asyncpg's pool logs a traceback at each failed reconnect while PostgreSQL is away, which the
    gateway reports in its own line: its records keep the exception's type and message, one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None:
            exc = record.exc_info[1]
            record.msg, record.args = f"{record.getMessage()}: {type(exc).__name__}: {exc}", ()
            record.exc_info = record.exc_text = None
        return True


logging.getLogger("asyncpg.pool").addFilter(OneLine())

POOL_SIZE = 5  # besides the admitter's and the writer's own connections (``Pinned``)
STATEMENT_TIMEOUT = 3.0  # seconds: a database that does not answer is treated as out of reach
LOCK_TIMEOUT = 2.0  # seconds a statement may wait for a lock, in the server (another session's lock)
SERVER_STATEMENT_TIMEOUT = 2.5  # seconds a statement may run, in the server: ended there before the client's
REMIND_SECONDS = 60.0  # while down, how often the log says so again
CONNECT_TIMEOUT = 5.0
# What a lost connection raises. InternalClientError: asyncpg's protocol state after a session was
# terminated mid-statement (MagicStack/asyncpg#1069); the pool's connections are then replaced.
UNREACHABLE = (OSError, asyncio.TimeoutError, asyncpg.InterfaceError, asyncpg.PostgresConnectionError,
               asyncpg.OperatorInterventionError, asyncpg.InternalClientError)


def down_error(exc: BaseException) -> bool:
    """Whether ``exc`` means the store cannot take statements now (rather than this batch failed):
    out of reach, or PostgreSQL refusing them (read-only, a full disk, a lock or statement timeout,
    too many connections, a password or a table gone)."""
    if isinstance(exc, UNREACHABLE):
        return True
    return isinstance(exc, asyncpg.PostgresError) and database_state(exc.sqlstate)


def redacted(url: str) -> str:
    """``url`` without its password, for messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rpartition("@")
    user = netloc[0].partition(":")[0]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc[2]}"))


def session_settings(replica: str) -> dict[str, str]:
    """The server settings of every connection of ``replica``: its name, and the server's bounds."""
    return {"application_name": f"kilnproxy {replica}",
            "lock_timeout": str(int(LOCK_TIMEOUT * 1000)),
            "statement_timeout": str(int(SERVER_STATEMENT_TIMEOUT * 1000))}


async def nothing_to_reset(conn: asyncpg.Connection) -> None:
    """The pool's check-in: the store changes no session state (only ``SET LOCAL``), so the
    round trip of asyncpg's default reset (``RESET ALL; UNLISTEN *; ...``) is saved."""


def numbered(sql: str) -> str:
    """``?`` placeholders as PostgreSQL's ``$1, $2, ...`` (the queries hold no literal ``?``)."""
    parts = sql.split("?")
    return "".join(f"{part}${i}" for i, part in enumerate(parts[:-1], 1)) + parts[-1]


def reason(exc: BaseException, secret: str | None = None) -> str:
    """The first line of ``exc``'s message (its type's name if none), ``secret`` (a password) hidden."""
    text = (str(exc).strip() or type(exc).__name__).splitlines()[0]
    return text.replace(secret, "***") if secret else text
