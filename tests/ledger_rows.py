"""Usage rows for the SQLite ledger's tests in store/: ``row(i)`` (a whole row with id ``i``),
``commit(ledger, *rows)`` (submit them and return once each is committed), ``stored_ids(path)`` (the ids in the
file, in the order they were inserted)."""

import asyncio
import sqlite3

from kilnproxy.store.sqlite.ledger import SQLiteLedger
from kilnproxy.usage import COLUMNS


def row(i: int) -> dict:
    values = dict.fromkeys(COLUMNS, 0)
    values.update(id=f"gen-{i:024x}", created_at="2026-11-30T10:00:00.000+00:00", org="acme", key_id="acme-key",
                  model="m", endpoint="completions", error_code=None, finish_reason="stop", requested_model="m",
                  upstream=None, batch_id=None)
    return values


def stored_ids(path) -> list[str]:
    """Ids in the table, in the order they were inserted."""
    db = sqlite3.connect(path)
    try:
        return [r[0] for r in db.execute("SELECT id FROM usage_events ORDER BY rowid")]
    finally:
        db.close()


async def commit(ledger: SQLiteLedger, *rows: dict) -> None:
    """Submit ``rows`` and return once each is committed (a lone row's future resolves at its journal append)."""
    await asyncio.gather(*(ledger.submit(r) for r in rows))
    for r in rows:
        assert await ledger.get(r["id"]) is not None
