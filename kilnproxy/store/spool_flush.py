"""Settling the spooled rows in PostgreSQL (``PostgresStore.flush_spool``), oldest first.

A batch PostgreSQL refuses for its own content (``kilnproxy.store.sqlstates``: a value it
cannot take, such as a NUL in a text, which rows spooled by an earlier release may hold) is
settled row by row, so that one bad row does not hold up the rows behind it for ever. A row
refused alone is tried once more with every NUL of its texts as U+FFFD (as rows are stored
now); refused still, it stays in the spool, set aside for the rest of the run (``stuck``), and
the log says so once for it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

log = logging.getLogger("kilnproxy.ledger")

FLUSH_ROWS = 500  # rows per settlement when the spool is flushed


def without_nuls(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v.replace("\x00", "\ufffd") if isinstance(v, str) else v for k, v in row.items()}


async def flush(store, batches: int | None = None) -> bool:
    """Settle ``store``'s spooled rows, ``FLUSH_ROWS`` at a time (``batches`` of them at most, and then
    even while the store is down: the heartbeat's probe); stops at the first failure of the store.
    Whether the last batch tried committed (True when there was nothing to settle)."""
    spool, stuck = store.spool, store.stuck
    while store.spooled > len(stuck) and (store.available or batches is not None):
        if batches is not None:
            if batches == 0:
                break
            batches -= 1
        rows = await asyncio.to_thread(spool.take, FLUSH_ROWS, stuck)
        if not rows:
            store.spooled = len(stuck)
            break
        if await store._settle(rows):
            settled = rows
        elif store.settle_error is None:  # the store is down
            return False
        else:
            settled = await _one_by_one(store, rows)
            if settled is None:
                return False
        await asyncio.to_thread(spool.remove, [r["id"] for r in settled])
        store.spooled = max(len(stuck), store.spooled - len(settled))
        if store.spooled == len(stuck):
            log.info("settled every spooled usage row%s",
                     f" but {len(stuck)} set aside" if stuck else "")
    return True


async def _one_by_one(store, rows: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """The rows of a refused batch, each alone; those settled (``None`` if the store went down)."""
    settled = []
    for row in rows:
        if (await store._settle([row], say=False)
                or store.settle_error is not None and await store._settle([without_nuls(row)], say=False)):
            settled.append(row)
        elif store.settle_error is None:
            return None
        else:
            store.stuck.add(row["id"])
            log.error("usage row %s cannot be settled in PostgreSQL (%s): it stays in the spool %s, set aside "
                      "until the next start of the replica", row["id"], store.settle_error, store.spool.path)
    return settled
