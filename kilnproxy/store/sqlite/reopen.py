"""A -wal, -shm or database file deleted under the gateway: the SQLite ledger's rows saved and its files opened anew.

``Reopening`` is the part of ``SQLiteLedger`` that does it (``_reopen``, started by the ledger's watch
every ``WATCH_SECONDS`` when ``file_ids`` changed); ``FileUser`` is what another connection of the
process to the file (the tenancy store's, the inspector's) does meanwhile: close, then open again.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sqlite3
from pathlib import Path
from typing import Protocol

log = logging.getLogger("kilnproxy.ledger")

WATCH_SECONDS = 0.5  # how often the ledger checks how long it has gone without a commit, and its files


class FileUser(Protocol):
    """Another connection of the gateway's process to the ledger's file (``SQLiteLedger.file_users``)."""

    async def pause(self) -> None:
        """Close the connection; operations wait until ``resume``."""

    async def resume(self) -> None:
        """Open it again."""


def file_ids(path: Path) -> tuple:
    """(device, inode) of the database, its -wal and its -shm; None for a file that is not there."""
    ids = []
    for name in (str(path), f"{path}-wal", f"{path}-shm"):
        try:
            st = os.stat(name)
        except OSError:
            ids.append(None)
        else:
            ids.append((st.st_dev, st.st_ino))
    return tuple(ids)


class Reopening:
    """``SQLiteLedger``'s files opened anew (its attributes: ``path``, ``_db``, ``_files``, ``_file_lock``,
    ``_reopen_error``, ``file_users``, ``checkpointer``; its ``_connect`` and ``_close_connections``)."""

    def _reopen_ended(self, task: asyncio.Future) -> None:
        exc = None if task.cancelled() else task.exception()
        if exc is not None and repr(exc) != self._reopen_error:  # a bug: said once, the next check tries again
            self._reopen_error = repr(exc)
            log.error("usage ledger: opening %s anew failed", self.path, exc_info=exc)

    async def _reopen(self) -> None:
        """The -wal or -shm file (or the database) was deleted while the gateway had it open. Its
        connections still write to the deleted file: a row committed there is in no file another program
        reads, and lost if the process dies; and a program that opens the database meanwhile makes a new
        -shm and writes beside the gateway, which corrupts the file. So: every commit waits, every row
        committed so far is copied from the open WAL into the database file (a checkpoint; a deleted
        database is written anew from the open one, ``VACUUM INTO``), every connection of the process to
        the file is closed (``file_users`` too), and all are opened again, on new files. A failure leaves
        the ledger unable to commit (down after a while), and it is tried again at the next check."""
        files = file_ids(self.path)
        gone = [name for name, now, then in zip(("database", "-wal", "-shm"), files, self._files) if now != then]
        if self._db is not None and files[0] is not None and files[0] != self._files[0]:
            if self._reopen_error != "replaced":
                self._reopen_error = "replaced"  # another file put in its place: the rows stay in the one open
                log.error("usage ledger: %s was replaced by another file while the gateway runs; rows still go "
                          "to the file it has open, which only a restart of the gateway leaves", self.path)
            return
        if self._db is not None and not self._reopen_error:  # said once, not at each try
            log.error("usage ledger: the %s file of %s was deleted while the gateway runs; copying the rows "
                      "committed since into the database and opening the files anew", " and ".join(gone),
                      self.path)
        await self.checkpointer.detach()  # from here every commit is the writer's, and the writer waits
        async with self._file_lock:
            paused = []
            closed = self._db is None
            try:
                for user in self.file_users:
                    await user.pause()
                    paused.append(user)
                if not closed:
                    await self._save_and_close(files[0] is None)
                    closed = True
                await self._connect()
                await self.checkpointer.attach()
            except (sqlite3.Error, OSError) as exc:
                if str(exc) != self._reopen_error:
                    log.error("usage ledger: cannot open %s anew: %s (tried again every %g s)", self.path, exc,
                              WATCH_SECONDS)
                self._reopen_error = str(exc)
                if closed:  # no connection left: every commit fails until a try succeeds
                    await self._close_connections()
                else:  # still on the deleted files: the commits go on there until the next try
                    await self.checkpointer.attach()
                return
            finally:
                for user in paused:
                    try:
                        await user.resume()
                    except Exception as exc:  # its own operations will fail, and say so
                        log.error("cannot open %s anew for %r: %s", self.path, user, exc)
        self._files = file_ids(self.path)
        self._reopen_error = ""
        log.warning("usage ledger: %s opened anew; every row committed is in it", self.path)

    async def _save_and_close(self, database_gone: bool) -> None:
        """Every row committed into the database file (or a new one), then every connection closed."""
        if database_gone:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            await self._db.execute_fetchall("VACUUM INTO ?", (str(self.path),))
        else:
            (busy, frames, copied), = await self._db.execute_fetchall("PRAGMA wal_checkpoint(FULL)")
            if busy or frames != copied:
                raise sqlite3.OperationalError(f"the checkpoint copied {copied} of {frames} WAL frames")
        await self._close_connections()
