"""SQLite WAL checkpoints off the commit path.

By default SQLite checkpoints inside whichever commit pushes the WAL past
1000 pages: that commit copies the WAL into the database and fsyncs both
files (about 10 ms on an ordinary disk), and the response waiting for its row
waits for all of it. The ledger's writer turns that off
(``PRAGMA wal_autocheckpoint=0``) and starts a ``Checkpointer``:

- In the background: once ``checkpoint_bytes`` of frames wait to be copied,
  a PASSIVE checkpoint on a connection of its own, in a thread of its own at
  the lowest CPU priority (on a gateway pinned to one core it must not take
  the core from the event loop). PASSIVE never waits for the writer or for
  readers. It is rare on purpose: its two fsyncs slow the commits that run
  beside them (on ext4, appends wait for the journal), so checkpoints of 64 MiB
  rather than SQLite's 4 MiB make that happen 16 times less often.
- The bound: SQLite starts the WAL again from its beginning only at a write
  that finds every frame copied, which a load that never pauses may not give.
  So once the WAL holds more than ``max_wal_bytes``, the writer itself
  checkpoints (TRUNCATE) between two commits, right after a background
  checkpoint has left little to copy: once per ``max_wal_bytes`` written. The
  WAL file stays within about ``max_wal_bytes`` (twice that at worst, when
  the background cannot keep up).
- The restart empties the WAL file, so that the commits after it append to
  new blocks. A frame (a page and its 24-byte header) never covers whole
  pages of the file, and the kernel reads from the disk any page of the file
  a write only partly covers that it no longer caches (a machine short of
  memory, or one that hands clean page cache back to its host, drops pages
  written minutes before): over a WAL started again in place, the commits on
  the event loop's thread would wait for those reads. A write past the end of
  the file reads nothing.
- A reader that keeps an old snapshot open (another program's transaction, a
  long ``kilnproxy usage``) keeps the WAL from starting over, however long it
  takes. The restart never waits for it (its busy timeout is 0): it is tried
  again ``RESTART_RETRY_SECONDS`` later, the commits go on meanwhile (on the
  loop's thread again), and the WAL grows past its bound until the reader ends;
  the log says so once, and once more when the WAL has started over.
- Both sizes come from the wal-index header (``-shm`` file: ``mxFrame`` at
  offset 16, ``nBackfill`` at 96, SQLite's documented WAL format): one
  ``pread``, no query, before each commit on the event loop's thread and after
  each of the writer's.

Durability is unchanged: a checkpoint moves committed rows from one file to
the other, and SQLite fsyncs before it lets the WAL be overwritten.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sqlite3
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ...tasks import cancelled

log = logging.getLogger("kilnproxy.ledger")

LOWEST_PRIORITY = 19
WAL_FRAME_HEADER = 24
RESTART_COPY_BYTES = 4 << 20  # what the writer's restart may have left to copy: a few ms of copying
RESTART_RETRY_SECONDS = 1.0  # a restart a reader kept from starting the WAL over is tried again after this


class Checkpointer:
    def __init__(self, path: Path, checkpoint_bytes: int = 64 << 20, max_wal_bytes: int = 256 << 20):
        self.path = Path(path)
        self.wal = Path(f"{self.path}-wal")
        self.checkpoint_bytes = checkpoint_bytes
        self.max_wal_bytes = max_wal_bytes
        self.checkpoints = 0          # background checkpoints run
        self.restarts = 0             # checkpoints the writer ran because the WAL reached its bound
        self.last = (0, 0)            # (frames in the WAL, frames copied) at the last background checkpoint
        self._wake = asyncio.Event()
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="kilnproxy-checkpoint")
        self._db: sqlite3.Connection | None = None
        self._shm = -1
        self._task: asyncio.Task | None = None
        self._restart_after = 0.0  # time.monotonic() before which no restart is tried (a reader was in the way)
        self._held_off_since: float | None = None  # when a reader first kept the WAL from starting over

    async def start(self) -> None:
        await self.attach()
        self._task = asyncio.create_task(self._loop(), name="kilnproxy-checkpoint")

    async def attach(self) -> None:
        """Open the connection and the wal-index (once the ledger's connections are open)."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._thread, self._connect)
        self._shm = os.open(f"{self.path}-shm", os.O_RDONLY)  # exists: a connection in WAL mode is open

    async def detach(self) -> None:
        """Close them, for the ledger to open the file anew (``attach`` again then). Meanwhile every
        commit is the writer's (``loop_must_hand_off`` is true: the sizes read are zero)."""
        if self._shm >= 0:
            shm, self._shm = self._shm, -1
            os.close(shm)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._thread, self._close)

    def committed(self) -> None:
        """Called by the writer after each commit: cheap, never blocks. Wakes the background
        checkpoint once ``checkpoint_bytes`` of frames wait to be copied."""
        wal, uncopied = self._sizes()
        if uncopied >= self.checkpoint_bytes:
            self._wake.set()

    def loop_must_hand_off(self) -> bool:
        """Before a commit on the event loop's thread: True when it is the writer's to make, the WAL
        being ``over_bound``, or starting over (empty, or every frame copied back: the next commit
        writes the WAL from its first frame, and SQLite fsyncs the header it then writes, even at
        ``synchronous=NORMAL``). One read of the wal-index header for all the checks: it also wakes
        the background checkpoint as ``committed`` does, for the frames of the loop's commits before
        this one (they do not call ``committed``)."""
        wal, uncopied = self._sizes()
        if uncopied >= self.checkpoint_bytes:
            self._wake.set()
        return uncopied == 0 or self._over_bound(wal, uncopied)

    def over_bound(self) -> bool:
        """True when the writer should restart the WAL before its next commit: it holds more than
        ``max_wal_bytes`` and the background has just copied nearly all of it (so the restart's
        copy is short), or more than twice that whatever is left to copy."""
        return self._over_bound(*self._sizes())

    def _over_bound(self, wal: int, uncopied: int) -> bool:
        return ((wal > 2 * self.max_wal_bytes or (wal > self.max_wal_bytes and uncopied <= RESTART_COPY_BYTES))
                and time.monotonic() >= self._restart_after)

    def restart_tried(self, restarted: bool, why: str = "a reader holds an old snapshot of the file") -> None:
        """Told by the writer after each restart: one that did not start the WAL over is tried again
        ``RESTART_RETRY_SECONDS`` later, not before each commit."""
        now = time.monotonic()
        if restarted:
            self.restarts += 1
            if self._held_off_since is not None:
                log.warning("usage ledger: the WAL started over after %.0f s", now - self._held_off_since)
                self._held_off_since = None
            return
        self._restart_after = now + RESTART_RETRY_SECONDS
        if self._held_off_since is None:
            self._held_off_since = now
            log.warning("usage ledger: the WAL (%d MB) cannot start over: %s (another program's open "
                        "transaction, a long read); commits go on, the WAL grows until it ends",
                        self._sizes()[0] >> 20, why)

    def _sizes(self) -> tuple[int, int]:
        """(bytes of frames in the WAL, bytes of them not yet copied into the database)."""
        try:
            header = os.pread(self._shm, 100, 0)
        except OSError:
            return 0, 0
        page = int.from_bytes(header[14:16], sys.byteorder) or 1
        frame = (65536 if page == 1 else page) + WAL_FRAME_HEADER
        frames = int.from_bytes(header[16:20], sys.byteorder)
        copied = int.from_bytes(header[96:100], sys.byteorder)  # nBackfill, in the checkpoint info
        return frames * frame, max(frames - copied, 0) * frame

    async def stop(self) -> None:
        self._task = await cancelled(self._task)
        await self.detach()
        self._thread.shutdown(wait=True)

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            await loop.run_in_executor(self._thread, self._checkpoint)

    def _connect(self) -> None:
        try:  # Linux: a thread's nice value is its own
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOWEST_PRIORITY)
        except (OSError, AttributeError):
            pass
        self._db = sqlite3.connect(self.path, timeout=0, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA synchronous=NORMAL")

    def _checkpoint(self) -> None:
        if self._db is None:  # detached: the file is being opened anew
            return
        try:
            # fetchall: a statement left unfinished would hold a read snapshot, and no checkpoint could end
            (busy, frames, copied), = self._db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
        except sqlite3.Error as exc:  # e.g. the writer is truncating right now: the next one will do
            log.debug("background checkpoint skipped: %s", exc)
            return
        self.checkpoints += 1
        self.last = (frames, copied)

    def _close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None
