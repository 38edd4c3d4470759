"""``BatchStore``: batches created, read, listed and cancelled, moved through their statuses, and
leased to one runner at a time.

A batch's row is its object (``kilnproxy.batches.objects`` shows it): ``status`` with its ``*_at``
times (integer Unix seconds), the counts, the files, ``errors`` and ``metadata`` as JSON text.

The lease: a runner (one per gateway process, its ``runner`` id random) runs a batch only while it
holds the batch's lease, ``lease_until`` ahead of now, which it renews; another takes a batch whose
lease has passed (its runner stopped or was lost). ``org`` None in a read means any org (the runner's).
"""

from __future__ import annotations

import os
import time
from typing import Any

import orjson

OPEN_STATUSES = ("validating", "in_progress", "finalizing", "cancelling")  # a runner has work on them
ENDED_STATUSES = ("completed", "failed", "expired", "cancelled")
BATCH_COLUMNS = ("id, org, key_id, endpoint, input_file_id, completion_window, metadata, status, errors, "
                 "output_file_id, error_file_id, total, completed, failed, created_at, expires_at, in_progress_at, "
                 "finalizing_at, completed_at, failed_at, expired_at, cancelling_at, cancelled_at")
_OPEN = ", ".join(f"'{s}'" for s in OPEN_STATUSES)


class _Unchanged(Exception):
    """Rolls a transaction back: the batch was no longer in the status it was taken in."""


def new_batch_id() -> str:
    """``batch_`` + the time in ms (12 hex digits) + 48 random bits: newer ids sort after older ones."""
    return f"batch_{int(time.time() * 1000):012x}{os.urandom(6).hex()}"


class BatchStore:
    def __init__(self, db: Any):
        self.db = db

    async def create(self, org: str, key_id: str, endpoint: str, input_file_id: str, window_seconds: int,
                     metadata: dict | None) -> dict[str, Any]:
        now = int(time.time())
        batch_id = new_batch_id()
        async with self.db.transaction() as tx:
            await tx.fetch(
                "INSERT INTO kiln_batches (id, org, key_id, endpoint, input_file_id, completion_window, metadata,"
                " status, created_at, expires_at) VALUES (?, ?, ?, ?, ?, ?, ?, 'validating', ?, ?)",
                batch_id, org, key_id, endpoint, input_file_id, "24h",
                None if metadata is None else orjson.dumps(metadata).decode(), now, now + window_seconds)
        return await self.get(org, batch_id)

    async def get(self, org: str | None, batch_id: str) -> dict[str, Any] | None:
        row = await self.db.fetchrow(f"SELECT {BATCH_COLUMNS} FROM kiln_batches WHERE id = ?", batch_id)
        if row is None or (org is not None and row["org"] != org):
            return None
        return row

    async def list(self, org: str, limit: int, after: str | None) -> list[dict[str, Any]]:
        """The org's batches, newest first, ``limit`` of them, those older than ``after``."""
        sql = f"SELECT {BATCH_COLUMNS} FROM kiln_batches WHERE org = ?"
        args: list[Any] = [org]
        if after is not None:
            sql += " AND id < ?"
            args.append(after)
        return await self.db.fetch(sql + " ORDER BY id DESC LIMIT ?", *args, limit)

    async def recent(self, limit: int, org: str | None = None) -> list[dict[str, Any]]:
        """Every org's batches (or ``org``'s), newest first (the inspector)."""
        if org is None:
            return await self.db.fetch(f"SELECT {BATCH_COLUMNS} FROM kiln_batches ORDER BY id DESC LIMIT ?", limit)
        return await self.db.fetch(f"SELECT {BATCH_COLUMNS} FROM kiln_batches WHERE org = ? ORDER BY id DESC LIMIT ?",
                                   org, limit)

    async def cancel(self, org: str, batch_id: str) -> dict[str, Any] | None:
        """A batch validating or in progress turns ``cancelling`` (its runner stops taking lines); a
        batch in any other status is left as it is. None when the org has no batch of that id."""
        async with self.db.transaction() as tx:
            await tx.fetch("UPDATE kiln_batches SET status = 'cancelling', cancelling_at = ?"
                           " WHERE id = ? AND org = ? AND status IN ('validating', 'in_progress')",
                           int(time.time()), batch_id, org)
        return await self.get(org, batch_id)

    async def state(self, batch_id: str) -> tuple[str, int]:
        """The batch's status and ``expires_at``, read anew (a cancel made elsewhere, a window changed)."""
        row = await self.db.fetchrow("SELECT status, expires_at FROM kiln_batches WHERE id = ?", batch_id)
        return row["status"], row["expires_at"]

    async def move(self, batch_id: str, status: str, *, when: tuple[str, ...] = (), **columns: Any) -> bool:
        """Set the batch's ``status`` (and its ``<status>_at``, and ``columns``), if its status is one of
        ``when`` (any, when empty); whether it moved."""
        sets = {f"{status}_at": int(time.time()), **columns}
        sql = "UPDATE kiln_batches SET status = ?, " + ", ".join(f"{name} = ?" for name in sets) + " WHERE id = ?"
        args: list[Any] = [status, *sets.values(), batch_id]
        if when:
            sql += " AND status IN (" + ", ".join("?" for _ in when) + ")"
            args.extend(when)
        async with self.db.transaction() as tx:
            return bool(await tx.fetch(sql + " RETURNING id", *args))

    async def conclude(self, batch_id: str, status: str, when: tuple[str, ...], files: list[tuple[str, int]],
                       **columns: Any) -> bool:
        """In one transaction: the batch's ``files`` complete and its status ``status`` (with ``columns``), if
        its status is one of ``when``; else nothing changes (False)."""
        now = int(time.time())
        sets = {f"{status}_at": now, **columns}
        try:
            async with self.db.transaction() as tx:
                moved = await tx.fetch(
                    "UPDATE kiln_batches SET status = ?, " + ", ".join(f"{name} = ?" for name in sets)
                    + " WHERE id = ? AND status IN (" + ", ".join("?" for _ in when) + ") RETURNING id",
                    status, *sets.values(), batch_id, *when)
                if not moved:
                    raise _Unchanged
                for file_id, size in files:
                    await tx.fetch("UPDATE kiln_files SET bytes = ?, complete = 1 WHERE id = ?", size, file_id)
        except _Unchanged:
            return False
        return True

    async def fail(self, batch_id: str, errors: list[dict[str, Any]]) -> None:
        """The input broke the rules: ``failed``, with ``errors.data`` naming each bad line."""
        await self.move(batch_id, "failed", when=("validating",),
                        errors=orjson.dumps({"object": "list", "data": errors}).decode())

    # -- the lease ---------------------------------------------------------------------------

    async def claimable(self, runner: str, limit: int) -> list[str]:
        """Open batches whose lease is free, passed, or ``runner``'s own, oldest first."""
        rows = await self.db.fetch(
            f"SELECT id FROM kiln_batches WHERE status IN ({_OPEN})"
            " AND (runner IS NULL OR runner = ? OR lease_until < ?) ORDER BY id LIMIT ?",
            runner, time.time(), limit)
        return [r["id"] for r in rows]

    async def lease(self, batch_id: str, runner: str, seconds: float) -> bool:
        """Take or renew the batch's lease for ``seconds``: False when another runner holds it."""
        now = time.time()
        async with self.db.transaction() as tx:
            return bool(await tx.fetch(
                "UPDATE kiln_batches SET runner = ?, lease_until = ? WHERE id = ?"
                " AND (runner IS NULL OR runner = ? OR lease_until < ?) RETURNING id",
                runner, now + seconds, batch_id, runner, now))

    async def release(self, batch_id: str, runner: str) -> None:
        async with self.db.transaction() as tx:
            await tx.fetch("UPDATE kiln_batches SET runner = NULL, lease_until = NULL WHERE id = ? AND runner = ?",
                           batch_id, runner)

    async def free_all_leases(self) -> None:
        """SQLite: the file has one gateway, so a lease found at start-up is a stopped process's. Written only
        when there is one: a write takes the file's lock, which the ledger's commits would then wait for."""
        leased = f"SELECT 1 FROM kiln_batches WHERE status IN ({_OPEN}) AND runner IS NOT NULL LIMIT 1"
        if await self.db.fetchval(leased) is None:
            return
        async with self.db.transaction() as tx:
            await tx.fetch(f"UPDATE kiln_batches SET runner = NULL, lease_until = NULL WHERE status IN ({_OPEN})")

    async def open_count(self) -> int:
        return await self.db.fetchval(f"SELECT count(*) FROM kiln_batches WHERE status IN ({_OPEN})")
