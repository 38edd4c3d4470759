"""Orgs whose row of ``kiln_orgs`` another session keeps locked: they alone wait, not the store.

A settlement adds its rows' cost to their orgs' ``spent``, so it needs each of
their rows of ``kiln_orgs``. Another session may keep one locked (an operator's
``SELECT ... FOR UPDATE`` left open in ``psql``, a long admin transaction): the
settlement then waits ``LOCK_TIMEOUT`` and PostgreSQL ends it with
``lock_not_available``. That is not the store being down: after such a
failure the orgs of the batch are probed (``probe``: their rows locked now,
without waiting for any), and if some are, only those orgs are set aside:

* the rest of the batch is settled at once (the store stays up);
* the rows of a set-aside org go to the spool, not tried by the writer (a
  2 s wait per batch would hold up every other org's rows), and its new
  requests get 503 ``store_unavailable`` at admission, saying why (its spending
  cannot be charged, and each request served would keep its slot and hold
  until the lock goes);
* the spool's flush (every heartbeat) tries that org's rows again, in a batch
  of their own (so that no other org's row is held while it waits); once one
  commits, the org is served again.

A failed probe, or a lock timeout where no org's row is locked (a whole table
locked, say), is still the store's state (``down_error``).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from ...errors import GatewayError
from ..ledger import store_unavailable

log = logging.getLogger("kilnproxy.ledger")

# The orgs among $1 whose row is locked by another session now: those FOR UPDATE SKIP LOCKED passes
# over. Never waits for a row (the rows it does lock are let go at the end of the statement).
PROBE = """
WITH free AS (SELECT org FROM kiln_orgs WHERE org = ANY($1::text[]) FOR UPDATE SKIP LOCKED)
SELECT org FROM kiln_orgs WHERE org = ANY($1::text[]) AND org NOT IN (SELECT org FROM free)
"""


def org_locked(org: str) -> GatewayError:
    """503 ``store_unavailable`` for a request of an org set aside."""
    return store_unavailable(f"The gateway cannot record the usage of org {org!r} now: its row in the database is "
                             "locked by another session. Retry with exponential backoff.")


class OrgLocks:
    """The orgs set aside (see the module's docstring), and the log lines of their coming and going."""

    def __init__(self, lock_timeout: float):
        self.lock_timeout = lock_timeout
        self.orgs: set[str] = set()

    def __contains__(self, org: str) -> bool:
        return org in self.orgs

    def split(self, rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """``rows`` as (those of orgs not set aside, those of orgs set aside)."""
        if not self.orgs:
            return rows, []
        free, held = [], []
        for row in rows:
            (held if row["org"] in self.orgs else free).append(row)
        return free, held

    async def probe(self, run: Callable, rows: list[dict[str, Any]]) -> set[str]:
        """The orgs of ``rows`` whose row is locked now (sent with ``run``); each new one is set aside
        and said once. Raises what the statement raises."""
        locked = {r["org"] for r in await run("fetch", PROBE, sorted({row["org"] for row in rows}))}
        for org in sorted(locked - self.orgs):
            log.error("usage rows of org %s cannot be settled: its row in kiln_orgs is locked by another session "
                      "for more than %g s; its new requests get 503 store_unavailable and its rows are spooled "
                      "until the lock goes", org, self.lock_timeout)
        self.orgs |= locked
        return locked

    def settled(self, rows: list[dict[str, Any]]) -> None:
        """``rows`` committed: their orgs are free again."""
        if self.orgs:
            for org in sorted(self.orgs & {row["org"] for row in rows}):
                self.orgs.discard(org)
                log.warning("org %s's row is free again: its spooled usage rows are settled and its requests "
                            "served again", org)
