"""Admission on PostgreSQL (request rule 5 (docs/reference.md)): ``PostgresStore``'s ``Admission`` side.

``admit`` is one round trip, shared by the requests admitted at the same moment
(``kiln_admit``, sent on the admitter's own connection, ``Pinned``): it takes
the org's admission lock, counts its live holds, checks its credits and inserts
the hold, for each in turn. ``rehold`` re-places a hold at a fallback's prices.
The holds' rows go with the requests' rows (``kilnproxy.store.postgres.settlement``):
``release`` and ``settled`` keep nothing but this replica's counts.
"""

from __future__ import annotations

import logging
from typing import Any

import asyncpg
import orjson

from ..ledger import UNREACHABLE_MESSAGE, store_unavailable
from ..limits import Hold, insufficient_credits, key_limit_exceeded, per_minute_exceeded, rate_limited
from .connection import UNREACHABLE
from .org_locks import org_locked

log = logging.getLogger("kilnproxy.ledger")

# Only the columns read, in the order ``admit`` unpacks them (not ``r_id``: a string decoded a row for nothing).
ADMIT = "SELECT r_verdict, r_spent FROM kiln_admit($1::jsonb, $2, $3)"


def per_minute_bounds(hold: Hold, item: dict[str, Any]) -> None:
    """The hold's per-minute bounds, as ``kiln_admit`` reads them, into its admission's ``item``
    (absent: no bound; ``kiln_admit`` reads a missing key as NULL)."""
    for name, rpm, tpm in hold.per_minute:
        who = "org" if name.startswith("org:") else "key"
        item[f"{who}_rpm"], item[f"{who}_tpm"] = rpm, tpm


class Admitting:
    """``PostgresStore``'s admission (its attributes: ``available``, ``credits``, ``org_locks``, ``admissions``,
    ``admitter``, ``counts``, ``replica``, ``timeout``; its ``lost``, ``run`` and ``journal_settled_all``)."""

    async def admit(self, hold: Hold, limit: int) -> None:
        """One ``kiln_admit`` for every request admitted at the same moment. A request cancelled
        while waiting may still get its hold; its row, submitted as always, deletes it."""
        if not self.available:
            raise store_unavailable(UNREACHABLE_MESSAGE)
        # an org set aside: its rows cannot be charged, and served it would keep its slot and hold
        if self.org_locks.orgs and hold.org in self.org_locks.orgs:
            raise org_locked(hold.org)
        item = {
            "id": hold.id, "org": hold.org, "limit": limit, "granted": self.credits.granted.get(hold.org, 0.0),
            "amount": hold.amount, "prompt_cost": hold.prompt_cost, "prompt_tokens": hold.prompt_tokens,
            "created_at": hold.created_at, "key_id": hold.key_id, "model": hold.model, "endpoint": hold.endpoint,
            "stream": hold.stream, "key_limit": hold.key_limit, "key_since": hold.key_since, "tokens": hold.tokens}
        if hold.per_minute:
            per_minute_bounds(hold, item)
        verdict, spent = await self.admissions.add(item)
        self.credits.spent[hold.org] = spent
        if verdict == "rate_limited":
            raise rate_limited(hold.org, limit)
        if verdict == "insufficient_credits":
            raise insufficient_credits(hold.org, holding=True)
        if verdict in ("org_per_minute", "key_per_minute"):
            raise per_minute_exceeded(f"org:{hold.org}" if verdict == "org_per_minute" else f"key:{hold.key_id}")
        if verdict == "key_limit_exceeded":
            raise key_limit_exceeded(hold.key_id, hold.key_limit)
        self.counts.taken(hold.org)

    async def _admit(self, holds: list[dict[str, Any]]) -> list[asyncpg.Record]:
        """Each hold's (verdict, spending of its org), in the order of ``holds``."""
        await self.journal_settled_all()  # this replica's requests whose responses ended count as settled
        if not self.available:  # went down while these waited for the batch before: refused at once
            raise store_unavailable(UNREACHABLE_MESSAGE)
        try:
            verdicts = await self.admitter.run("fetch", ADMIT, orjson.dumps(holds).decode(), self.replica,
                                               self.timeout)
        except (*UNREACHABLE, asyncpg.PostgresError) as exc:
            if not self.lost(exc):  # a deadlock: these requests get 503, the next batch is tried anew
                log.error("admission of %d requests failed: %s", len(holds), exc)
            raise store_unavailable(UNREACHABLE_MESSAGE) from None
        return verdicts  # records of (r_verdict, r_spent): unpacked as pairs

    async def rehold(self, hold: Hold, new: Hold) -> None:
        """A fallback's prices: one ``kiln_rehold`` round trip under the org's admission lock."""
        if not self.available:
            raise store_unavailable(UNREACHABLE_MESSAGE)
        try:
            row = await self.run("fetchrow", "SELECT * FROM kiln_rehold($1::jsonb, $2)", orjson.dumps({
                "id": hold.id, "org": hold.org, "granted": self.credits.granted.get(hold.org, 0.0),
                "amount": new.amount, "prompt_cost": new.prompt_cost, "prompt_tokens": new.prompt_tokens,
                "key_id": hold.key_id, "model": new.model, "requested_model": hold.model,
                "key_limit": hold.key_limit, "key_since": hold.key_since}).decode(), self.timeout)
        except (*UNREACHABLE, asyncpg.PostgresError) as exc:
            if not self.lost(exc):
                log.error("re-placing the hold of %s failed: %s", hold.id, exc)
            raise store_unavailable(UNREACHABLE_MESSAGE) from None
        self.credits.spent[hold.org] = row["r_spent"]
        if row["r_verdict"] == "insufficient_credits":
            raise insufficient_credits(hold.org, holding=True)
        if row["r_verdict"] == "key_limit_exceeded":
            raise key_limit_exceeded(hold.key_id, hold.key_limit)

    def release(self, hold: Hold) -> None:
        """Local bookkeeping only: the hold's row in PostgreSQL goes with the request's row."""
        self.counts.given_back(hold.org)

    def settled(self, hold: Hold | None, row: dict[str, Any]) -> None:
        """Nothing to keep here: ``kiln_admit`` reads a key's spending from its rows, and the rows'
        settlement (``kiln_settle``) settles their per-minute tokens."""

    def held(self, org: str) -> float:
        """0.0: this replica holds nothing in memory; every replica's holds are rows of ``kiln_holds``
        (``kilnproxy.store.books.held_by_org``)."""
        return 0.0

    def count(self, org: str) -> int:
        return self.counts.count(org)

    def snapshot(self) -> dict[str, int]:
        return self.counts.snapshot()
