"""``Batches``: work of many requests queued, done together by one task, one batch at a time.

Used for the usage rows (group commit, SQLite and PostgreSQL) and for
admission on PostgreSQL. The request path calls ``add(item, tag)``, which never
blocks and never raises, and awaits the returned future. One task takes
everything queued and calls ``process(items)`` once; each future gets its
item's result (or, if ``process`` raised, that exception); then ``done`` is
told of the batch, each item with its tag. While a batch is processed, new
items queue for the next one: the more requests arrive at once, the larger and
fewer the round trips.

For rows, ``process`` returns only once they are durable and never raises (it
retries, or keeps them somewhere durable, itself): no row is dropped.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable, Sequence

Process = Callable[[list[Any]], Awaitable[Sequence[Any] | None]]


class Batches:
    def __init__(self, process: Process, name: str,
                 done: Callable[[list[tuple[Any, Any]]], None] | None = None):
        self._process = process
        self._done = done
        self._name = name
        self._pending: list[tuple[Any, asyncio.Future, Any]] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._closing = False
        self.processing = False  # a batch is being processed
        self.batches = 0
        self.items_done = 0
        self.last_batch_seconds = 0.0

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=self._name)

    def add(self, item: Any, tag: Any = None) -> asyncio.Future:
        """Queue ``item``; the future resolves with its result once its batch is processed."""
        future = asyncio.get_running_loop().create_future()
        self._pending.append((item, future, tag))
        self._wake.set()
        return future

    def queue_depth(self) -> int:
        return len(self._pending)

    def lone(self) -> bool:
        """Whether the item just added is the only one queued and no batch is being processed."""
        return len(self._pending) == 1 and not self.processing

    async def close(self) -> None:
        """Process everything queued, then stop."""
        if self._task is not None:
            self._closing = True
            self._wake.set()
            await self._task
            self._task = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            if not self._pending:
                if self._closing:
                    return
                continue
            batch, self._pending = self._pending, []
            started = loop.time()
            self.processing = True
            try:
                results = await self._process([item for item, _, _ in batch])
            except Exception as exc:  # every request of the batch is told; the next batch is tried anew
                for _, future, _ in batch:
                    if not future.done():
                        future.set_exception(exc)
                continue
            finally:
                self.processing = False
                if self._pending or self._closing:
                    self._wake.set()
            self.batches += 1
            self.items_done += len(batch)
            self.last_batch_seconds = loop.time() - started
            for i, (_, future, _) in enumerate(batch):
                if not future.done():
                    future.set_result(None if results is None else results[i])
            if self._done is not None:
                self._done([(item, tag) for item, _, tag in batch])


class GroupCommitted:
    """The ``Ledger`` methods of a store whose rows go through ``self.rows`` (a ``Batches``
    over its ``_commit``): submit, queue depth and the figures ops metrics read."""

    rows: Batches
    on_commit: Callable[[list[tuple[Any, Any]]], None] | None
    commit_failures: int
    refuses_requests = False  # the SQLite ledger while it cannot commit: new requests are refused at once

    def submit(self, row: dict[str, Any], tag: Any = None) -> asyncio.Future:
        """Queue ``row``; the future resolves once it is durable. ``tag`` is handed back to
        ``on_commit`` with the row."""
        return self.rows.add(row, tag)

    def queue_depth(self) -> int:
        return self.rows.queue_depth()

    @property
    def commits(self) -> int:
        return self.rows.batches

    @property
    def last_commit_seconds(self) -> float:
        return self.rows.last_batch_seconds

    def _committed(self, batch: list[tuple[dict[str, Any], Any]]) -> None:
        if self.on_commit is not None:
            self.on_commit(batch)

    def stats(self) -> dict[str, float]:
        """Cheap numbers for ops metrics: rows waiting, transactions and rows committed,
        failed commit attempts, and how long the last commit took (seconds)."""
        return {"queue_depth": self.rows.queue_depth(), "commits": self.rows.batches,
                "rows_committed": self.rows.items_done, "commit_failures": self.commit_failures,
                "last_commit_seconds": self.rows.last_batch_seconds}
