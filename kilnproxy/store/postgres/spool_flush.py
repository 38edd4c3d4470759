"""Settling the spooled rows in PostgreSQL (``PostgresStore.flush_spool``), oldest first.

A batch PostgreSQL refuses for its own content (``kilnproxy.store.postgres.sqlstates``: a value it
cannot take, such as a NUL in a text, which rows spooled by an earlier release may hold) is
settled row by row, so that one bad row does not hold up the rows behind it for ever. A row
refused alone is tried once more with every NUL of its texts as U+FFFD (as rows are stored
now); refused still, it stays in the spool, set aside for the rest of the run (``stuck``), and
the log says so once for it.

The rows of an org whose row of ``kiln_orgs`` another session keeps locked
(``kilnproxy.store.postgres.org_locks``) are tried once per flush, in a batch of their own (one per org:
no other org's row is held while it waits for the lock); still locked, they stay in the spool,
left out until the next flush.
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
    aside: set[str] = set()  # ids of rows of orgs still locked: left out until the next flush
    locked: set[str] = set()  # those orgs
    while store.spooled > len(stuck) + len(aside) and (store.available or batches is not None):
        if batches is not None:
            if batches == 0:
                break
            batches -= 1
        rows = await asyncio.to_thread(spool.take, FLUSH_ROWS, stuck | aside)
        if not rows:
            store.spooled = len(stuck) + len(aside)
            break
        settled = await _settled(store, rows, locked)
        if settled is None:  # the store is down
            return False
        done = {r["id"] for r in settled}
        aside |= {r["id"] for r in rows if r["id"] not in done and r["org"] in store.org_locks}
        await asyncio.to_thread(spool.remove, list(done))
        store.spooled = max(len(stuck) + len(aside), store.spooled - len(settled))
        if store.spooled == len(stuck) and not aside:
            log.info("settled every spooled usage row%s",
                     f" but {len(stuck)} set aside" if stuck else "")
    return True


async def _settled(store, rows: list[dict[str, Any]], locked: set[str]) -> list[dict[str, Any]] | None:
    """Those of ``rows`` committed (``None``: none, the store is down). The rows of each org set aside
    and not yet found ``locked`` in this flush are tried alone; orgs found locked are added to ``locked``."""
    free, held = store.org_locks.split(rows)
    settled: list[dict[str, Any]] = []
    for org in sorted({r["org"] for r in held} - locked):
        mine = [r for r in held if r["org"] == org]
        if await store.settle(mine):
            settled += mine
        elif store.locked_now:
            locked.add(org)
        elif store.settle_error is None:
            return None
        else:
            some = await _one_by_one(store, mine)
            if some is None:
                return None
            settled += some
    while free:
        if await store.settle(free):
            settled += free
            break
        if store.locked_now:  # some org of ``free`` found locked: set aside, the others tried again
            locked |= store.org_locks.orgs
            free, _ = store.org_locks.split(free)
            continue
        if store.settle_error is None:
            return None
        some = await _one_by_one(store, free)
        if some is None:
            return None
        settled += some
        break
    return settled


async def _one_by_one(store, rows: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """The rows of a refused batch, each alone; those settled (``None`` if the store went down)."""
    settled = []
    for row in rows:
        if (await store.settle([row], say=False)
                or store.settle_error is not None and await store.settle([without_nuls(row)], say=False)):
            settled.append(row)
        elif store.locked_now:  # its org's row is locked: left in the spool for the next flush
            continue
        elif store.settle_error is None:
            return None
        else:
            store.stuck.add(row["id"])
            log.error("usage row %s cannot be settled in PostgreSQL (%s): it stays in the spool %s, set aside "
                      "until the next start of the replica", row["id"], store.settle_error, store.spool.path)
    return settled
