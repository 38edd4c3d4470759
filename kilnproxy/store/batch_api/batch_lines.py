"""``LineStore``: a batch's lines, from checked to their outcomes.

A line is stored once the whole input passed its checks (``insert``; ``clear`` first, so a check
stopped half way is done again from the start). Then the runner ``take``s pending lines, each marked
``sent`` under the generation id its request will have *before* it is sent; its outcome is recorded
(``finish``) in the transaction that counts it in the batch's ``completed`` or ``failed``, and only
while the line is still ``sent`` under that id: a line's outcome is recorded, and counted, once. A
line refused for a while (429, 503) goes back to ``pending`` (``retry_later``). A line found ``sent``
by a runner that did not send it (its process stopped) is resolved from its usage row by the runner.
"""

from __future__ import annotations

import time
from typing import Any, AsyncIterator, Callable, Iterable

PAGE = 500  # lines read (or written) per statement when a batch's lines are walked


class LineStore:
    def __init__(self, db: Any):
        self.db = db

    async def clear(self, batch_id: str) -> None:
        async with self.db.transaction() as tx:
            await tx.fetch("DELETE FROM kiln_batch_lines WHERE batch_id = ?", batch_id)

    async def insert(self, batch_id: str, lines: Iterable[tuple[int, str, str]]) -> None:
        """Lines ``(line, custom_id, body as JSON text)``, in one transaction."""
        async with self.db.transaction() as tx:
            for line, custom_id, body in lines:
                await tx.fetch("INSERT INTO kiln_batch_lines (batch_id, line, custom_id, body) VALUES (?, ?, ?, ?)",
                               batch_id, line, custom_id, body)

    async def duplicates(self, batch_id: str, limit: int) -> list[dict[str, Any]]:
        """Lines whose ``custom_id`` an earlier line of the batch has, in order."""
        return await self.db.fetch(
            "SELECT l.line, l.custom_id FROM kiln_batch_lines l WHERE l.batch_id = ? AND EXISTS ("
            "SELECT 1 FROM kiln_batch_lines m WHERE m.batch_id = l.batch_id AND m.custom_id = l.custom_id"
            " AND m.line < l.line) ORDER BY l.line LIMIT ?", batch_id, limit)

    async def take(self, batch_id: str, limit: int, new_id: Callable[[], str]) -> list[dict[str, Any]]:
        """Up to ``limit`` pending lines due now, in order, each marked ``sent`` under a new generation id."""
        taken = []
        async with self.db.transaction() as tx:
            rows = await tx.fetch("SELECT line, custom_id, body, attempts FROM kiln_batch_lines WHERE batch_id = ?"
                                  " AND state = 'pending' AND not_before <= ? ORDER BY line LIMIT ?",
                                  batch_id, time.time(), limit)
            for row in rows:
                row["generation_id"] = generation_id = new_id()
                await tx.fetch("UPDATE kiln_batch_lines SET state = 'sent', generation_id = ?, attempts = attempts + 1"
                               " WHERE batch_id = ? AND line = ?", generation_id, batch_id, row["line"])
                taken.append(row)
        return taken

    async def retry_later(self, batch_id: str, line: int, generation_id: str, delay: float) -> None:
        async with self.db.transaction() as tx:
            await tx.fetch("UPDATE kiln_batch_lines SET state = 'pending', generation_id = NULL, not_before = ?"
                           " WHERE batch_id = ? AND line = ? AND state = 'sent' AND generation_id = ?",
                           time.time() + delay, batch_id, line, generation_id)

    async def finish(self, batch_id: str, line: int, generation_id: str, ok: bool, result: str) -> bool:
        """Record the line's outcome and count it, if it is still ``sent`` under ``generation_id``."""
        async with self.db.transaction() as tx:
            done = await tx.fetch("UPDATE kiln_batch_lines SET state = 'done', ok = ?, result = ?"
                                  " WHERE batch_id = ? AND line = ? AND state = 'sent' AND generation_id = ?"
                                  " RETURNING line", int(ok), result, batch_id, line, generation_id)
            if done:
                column = "completed" if ok else "failed"
                await tx.fetch(f"UPDATE kiln_batches SET {column} = {column} + 1 WHERE id = ?", batch_id)
        return bool(done)

    async def sent(self, batch_id: str) -> list[dict[str, Any]]:
        """The lines marked ``sent`` (a runner resolves those it did not send itself)."""
        return await self.db.fetch("SELECT line, custom_id, generation_id, attempts FROM kiln_batch_lines"
                                   " WHERE batch_id = ? AND state = 'sent' ORDER BY line", batch_id)

    async def held(self, generation_id: str) -> bool:
        """Whether a request of that id is still held in flight by a replica (PostgreSQL's holds; a
        SQLite file's holds live in its one process, gone when it stopped)."""
        if self.db.dialect != "postgresql":
            return False
        return await self.db.fetchval("SELECT 1 FROM kiln_holds WHERE id = ?", generation_id) is not None

    async def own_row(self, generation_id: str, batch_id: str) -> None:
        """Name the batch in a line's usage row written without it (PostgreSQL's ``replica_lost`` rows: a
        replica's reap knows the hold, not the batch)."""
        async with self.db.transaction() as tx:
            await tx.fetch("UPDATE usage_events SET batch_id = ? WHERE id = ? AND batch_id IS NULL",
                           batch_id, generation_id)

    async def pending(self, batch_ids: list[str]) -> int:
        """Lines waiting to run in these batches (the batch queue's depth)."""
        if not batch_ids:
            return 0
        total = 0
        for batch_id in batch_ids:
            total += await self.db.fetchval("SELECT count(*) FROM kiln_batch_lines WHERE batch_id = ?"
                                            " AND state = 'pending'", batch_id)
        return total

    async def states(self, batch_id: str) -> dict[str, int]:
        rows = await self.db.fetch("SELECT state, count(*) AS n FROM kiln_batch_lines WHERE batch_id = ?"
                                   " GROUP BY state", batch_id)
        return {r["state"]: r["n"] for r in rows}

    async def next_due(self, batch_id: str) -> float | None:
        """When the earliest pending line may run (Unix seconds), or None when none is pending."""
        return await self.db.fetchval("SELECT min(not_before) FROM kiln_batch_lines WHERE batch_id = ?"
                                      " AND state = 'pending'", batch_id)

    async def expire(self, batch_id: str) -> int:
        """Every pending line turns ``expired``, counted as failed; how many."""
        async with self.db.transaction() as tx:
            rows = await tx.fetch("UPDATE kiln_batch_lines SET state = 'expired' WHERE batch_id = ?"
                                  " AND state = 'pending' RETURNING line", batch_id)
            if rows:
                await tx.fetch("UPDATE kiln_batches SET failed = failed + ? WHERE id = ?", len(rows), batch_id)
        return len(rows)

    async def ended(self, batch_id: str, ok: bool) -> AsyncIterator[dict[str, Any]]:
        """The lines that ended well (``ok``) or not (the others, expired ones included), in order,
        ``PAGE`` at a time: ``line``, ``custom_id``, ``state``, ``result``."""
        condition = "state = 'done' AND ok = 1" if ok else "(state = 'done' AND ok = 0 OR state = 'expired')"
        last = 0
        while True:
            rows = await self.db.fetch(f"SELECT line, custom_id, state, result FROM kiln_batch_lines"
                                       f" WHERE batch_id = ? AND line > ? AND {condition} ORDER BY line LIMIT ?",
                                       batch_id, last, PAGE)
            for row in rows:
                yield row
            if len(rows) < PAGE:
                return
            last = rows[-1]["line"]

    async def counted(self, batch_id: str, ok: bool) -> int:
        condition = "state = 'done' AND ok = 1" if ok else "(state = 'done' AND ok = 0 OR state = 'expired')"
        return await self.db.fetchval(f"SELECT count(*) FROM kiln_batch_lines WHERE batch_id = ? AND {condition}",
                                      batch_id)
