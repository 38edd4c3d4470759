"""Telling a running gateway that orgs, keys or grants changed in the store, within a second.

``ChangeWatch`` calls ``on_change()`` (a coroutine function) whenever the change
counter may have moved; the callee reads the counter and reloads only when it
did (``kilnproxy.proxy.tenancy.key_ring.Tenants.refresh``).

* SQLite: the counter is read every ``SQLITE_POLL`` seconds, a one-row read on
  the tenancy connection. It sees the changes of the ``kilnproxy orgs``/``keys``
  commands, which write the same file from another process.
* PostgreSQL: ``LISTEN kiln_tenancy`` on a connection of its own (each change
  sends ``NOTIFY`` in its transaction, so every replica hears of it at its
  commit), plus a check every ``POSTGRES_POLL`` seconds for a notification
  missed while that connection was down; it reconnects after a failure, and
  checks once at each reconnection.

While the store cannot be read (an outage), the log says so once, then once
every ``REMIND_SECONDS``, and once more when it can be read again: not at
every check.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

from ...tasks import cancelled, woken
from .sql import NOTIFY_CHANNEL

log = logging.getLogger("kilnproxy.tenancy")

SQLITE_POLL = 0.5
POSTGRES_POLL = 5.0
CONNECT_TIMEOUT = 5.0
REMIND_SECONDS = 60.0


class ChangeWatch:
    def __init__(self, on_change: Callable[[], Awaitable[None]], postgres_url: str | None = None):
        self.on_change = on_change
        self.url = postgres_url
        self.poll = SQLITE_POLL if postgres_url is None else POSTGRES_POLL
        self._nudged = asyncio.Event()
        self._conn = None
        self._task: asyncio.Task | None = None
        self._trouble: dict[str, tuple[float, float]] = {}  # what fails -> (since, said at), loop times

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kilnproxy-tenancy-watch")

    async def stop(self) -> None:
        await cancelled(self._task)
        self._task = None
        await self._disconnect()

    def nudge(self, *_args) -> None:
        """A notification came (asyncpg's listener callback): check now."""
        self._nudged.set()

    async def _run(self) -> None:
        while True:
            if self.url is not None and self._conn is None:
                await self._listen()
            await woken(self._nudged, self.poll)
            self._nudged.clear()
            try:
                await self.on_change()
            except Exception as exc:  # the store out of reach: the next check tries again
                self._failed("read runtime orgs and keys from the store", exc)
            else:
                self._recovered("read runtime orgs and keys from the store")

    def _failed(self, what: str, exc: BaseException) -> None:
        now = asyncio.get_running_loop().time()
        since, said = self._trouble.get(what, (None, 0.0))
        if since is None:
            self._trouble[what] = (now, now)
            log.warning("cannot %s: %s (tried again every %g s)", what, exc, self.poll)
        elif now - said >= REMIND_SECONDS:
            self._trouble[what] = (since, now)
            log.warning("still cannot %s after %.0f s: %s", what, now - since, exc)

    def _recovered(self, what: str) -> None:
        if what in self._trouble:
            since, _ = self._trouble.pop(what)
            log.warning("can %s again after %.1f s", what, asyncio.get_running_loop().time() - since)

    async def _listen(self) -> None:
        import asyncpg  # only with PostgreSQL configured

        try:
            self._conn = await asyncpg.connect(self.url, timeout=CONNECT_TIMEOUT)
            await self._conn.add_listener(NOTIFY_CHANNEL, self.nudge)
            self._conn.add_termination_listener(self._lost)
        except Exception as exc:
            self._failed("listen for changes of orgs and keys", exc)
            await self._disconnect()
            return
        self._recovered("listen for changes of orgs and keys")
        self._nudged.set()  # whatever changed while no one listened

    def _lost(self, _conn) -> None:
        self._conn = None

    async def _disconnect(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None and not conn.is_closed():
            try:
                await asyncio.wait_for(conn.close(), CONNECT_TIMEOUT)
            except Exception:
                conn.terminate()
