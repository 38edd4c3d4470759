"""Per-org admission state: requests in flight, and credits.

Both sit behind small interfaces so that a shared store (Redis for the
in-flight counts, the PostgreSQL ledger for spending) can replace the
in-process ones for several gateway replicas, without touching the request path.

``InFlight`` is shaped for that: ``try_acquire`` is awaited (a shared counter
needs a round trip before the request may go on), while ``release`` must not
block or raise, because it runs in the request's ``finally``, possibly while the
handler is being cancelled; a shared store queues the release and owns its retries,
as the ledger does with rows.
"""

from __future__ import annotations

from typing import Protocol


class InFlight(Protocol):
    async def try_acquire(self, org: str, limit: int) -> bool:
        """Take a slot unless ``org`` already has ``limit`` requests in flight. Cancelled
        while waiting, it must leave no slot taken."""

    def release(self, org: str) -> None:
        """Give a taken slot back; called exactly once per slot, on every path."""

    def count(self, org: str) -> int:
        """Requests of ``org`` in flight (for metrics and tests)."""


class LocalInFlight:
    """In-flight counts of this process. A slot taken must be released exactly once."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}

    async def try_acquire(self, org: str, limit: int) -> bool:
        n = self._counts.get(org, 0)
        if n >= limit:
            return False
        self._counts[org] = n + 1
        return True

    def release(self, org: str) -> None:
        n = self._counts[org] - 1
        if n:
            self._counts[org] = n
        else:
            del self._counts[org]

    def count(self, org: str) -> int:
        return self._counts.get(org, 0)

    def snapshot(self) -> dict[str, int]:
        return dict(self._counts)


class Credits:
    """Granted credits come from the config; spending is the ledger's ``SUM(cost)``.

    ``spent`` is loaded from the ledger at start-up and kept current by
    ``charge`` as rows are submitted, so the check costs no query. Raising a
    grant in the config never resets spending: spending lives in the ledger.
    """

    def __init__(self, granted: dict[str, float], spent: dict[str, float]):
        self.granted = dict(granted)
        self.spent = {org: spent.get(org, 0.0) for org in set(granted) | set(spent)}

    def remaining(self, org: str) -> float:
        return self.granted.get(org, 0.0) - self.spent.get(org, 0.0)

    def charge(self, org: str, cost: float) -> None:
        if cost:
            self.spent[org] = self.spent.get(org, 0.0) + cost
