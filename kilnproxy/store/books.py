"""What each org has spent and holds, read from either store; and the store as a command opens it.

The org object of the admin API and of ``kilnproxy orgs`` (``kilnproxy.proxy.tenancy.views``)
shows ``spent`` and ``held`` beside ``granted``. Here are the reads behind
them, on a ``tenancy_sql.SQLiteDb`` or ``PostgresDb``:

* ``spent_by_org``: on PostgreSQL the ``kiln_orgs`` totals every replica keeps
  (what ``/v1/credits`` reads); on SQLite the ``SUM(cost)`` of each org's rows.
* ``held_by_org``: PostgreSQL only, the holds of the requests in flight on every
  replica seen within ``replica_timeout`` seconds (the holds admission counts).
  On SQLite the holds live in the gateway's memory: a command cannot see them.

``open_command_store(config)``: the ``TenancyStore`` of the store a config names,
for a command that runs beside (or without) a gateway: the SQLite file, made
and migrated if new, or one PostgreSQL connection, its schema migrated.
Failures are ``StorageError`` (one line, the URL's password hidden).
"""

from __future__ import annotations

import asyncio
import sqlite3
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

from ..config import Config
from ..errors import StorageError
from ..usage import round_usd
from .sqlite.schema import prepare_file
from .tenancy.orgs_keys import TenancyStore
from .tenancy.sql import PostgresDb, SQLiteDb

SPENT_SQLITE = "SELECT org, SUM(cost) AS spent FROM usage_events GROUP BY org"
SPENT_POSTGRES = "SELECT org, spent FROM kiln_orgs"
HELD_POSTGRES = ("SELECT k.org, SUM(k.amount) AS held FROM kiln_holds k JOIN kiln_replicas r ON r.id = k.replica "
                 "WHERE r.seen_at > now() - make_interval(secs => ?) GROUP BY k.org")
COMMAND_TIMEOUT = 10.0  # seconds: a command's statements and its connection to PostgreSQL


async def spent_by_org(db: Any) -> dict[str, float]:
    """USD spent by each org that has spent anything, as the store has it (every replica's rows)."""
    rows = await db.fetch(SPENT_POSTGRES if db.dialect == "postgresql" else SPENT_SQLITE)
    return {r["org"]: round_usd(r["spent"] or 0.0) for r in rows}


async def held_by_org(db: Any, replica_timeout: float) -> dict[str, float] | None:
    """USD held by each org's requests in flight on every live replica; None on SQLite (unknown here)."""
    if db.dialect != "postgresql":
        return None
    rows = await db.fetch(HELD_POSTGRES, float(replica_timeout))
    return {r["org"]: round_usd(r["held"] or 0.0) for r in rows}


@asynccontextmanager
async def open_command_store(config: Config) -> AsyncIterator[TenancyStore]:
    """The ``TenancyStore`` of ``config``'s store, closed on exit (see the module's docstring)."""
    url = config.storage.url
    if url is None:
        db = SQLiteDb(config.db_path)
        try:
            await asyncio.to_thread(prepare_file, config.db_path)
        except (sqlite3.Error, OSError) as exc:
            raise StorageError(f"cannot open the database {str(config.db_path)!r}: {exc}") from None
        await db.open()
        try:
            yield TenancyStore(db)
        finally:
            await db.close()
        return
    from .postgres import schema as postgres_schema
    from .reads import pg_close, pg_connect
    conn = await pg_connect(url)
    try:
        await asyncio.wait_for(postgres_schema.migrate(conn), COMMAND_TIMEOUT)
        yield TenancyStore(PostgresDb(conn, timeout=COMMAND_TIMEOUT))
    finally:
        await pg_close(conn)
