"""``BatchService``: what the Batch API's endpoints and runner share in one gateway: the store's files,
batches and lines (on the ledger's own database), the config, the runner; ``BATCHES``, its app key."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from ..config import Config
from ..proxy.gateway import Gateway
from ..store.batch_api.batch_lines import LineStore
from ..store.batch_api.batch_rows import BatchStore
from ..store.batch_api.files import FileStore
from ..store.batch_api.tables import BatchDb
from ..store.tenancy.sql import PostgresDb


class BatchService:
    def __init__(self, gw: Gateway):
        self.gw = gw
        self.config: Config = gw.config
        self.db: Any = None
        self.files: FileStore | None = None
        self.batches: BatchStore | None = None
        self.lines: LineStore | None = None
        self.runner: Any = None  # the BatchRunner, once started (kilnproxy.batches.runner)

    @property
    def shared(self) -> bool:
        """On PostgreSQL: other replicas run batches of the same store."""
        return self.gw.ledger.pool is not None

    async def open(self) -> None:
        """On the ledger's database: its pool (PostgreSQL), or its file on a connection of our own."""
        gw = self.gw
        if gw.ledger.pool is not None:
            self.db = PostgresDb(gw.ledger.pool, timeout=gw.ledger.STATEMENT_TIMEOUT)
        else:
            self.db = BatchDb(gw.config.db_path)
            await self.db.open()
            if gw.ledger.file_users is not None:  # closed and opened again with the ledger's if its files are deleted
                gw.ledger.file_users.append(self.db)
        self.files, self.batches, self.lines = FileStore(self.db), BatchStore(self.db), LineStore(self.db)

    async def close(self) -> None:
        if self.db is None:
            return
        file_users = self.gw.ledger.file_users
        if file_users is not None and self.db in file_users:
            file_users.remove(self.db)
        await self.db.close()
        self.db = None


BATCHES = web.AppKey("batches", BatchService)
