"""Several real ``python -m kilnproxy`` replicas on one PostgreSQL database, for tests.

``replica(tmp_path, name, mock_url, pg_url, **sections)`` starts one in its
own folder (its config and spool there); ``Ledger(pg_url)`` reads the shared
tables with asyncpg. Tests wait for events (``eventually``), never for time.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
from processes import GatewayProcess, gateway_config

from kilnproxy.testing import KEY, completion_body

TIMEOUT = 2.0  # [storage] replica_timeout_seconds of the test replicas


def replica_config(mock_url: str, pg_url: str, **sections: Any) -> dict[str, Any]:
    storage = {"url": pg_url, "replica_timeout_seconds": TIMEOUT, "spool_path": "spool.db",
               **sections.pop("storage", {})}
    return gateway_config([mock_url], storage=storage, inspector={"enabled": False}, **sections)


async def replica(tmp_path: Path, name: str, mock_url: str, pg_url: str, **sections: Any) -> GatewayProcess:
    folder = Path(tmp_path) / name
    folder.mkdir(exist_ok=True)
    return await GatewayProcess(folder, replica_config(mock_url, pg_url, **sections)).start()


async def two_replicas(tmp_path: Path, mock_url: str, pg_url: str, **sections: Any):
    """Replicas ``a`` and ``b`` on one database, started at the same moment."""
    return await asyncio.gather(replica(tmp_path, "a", mock_url, pg_url, **sections),
                                replica(tmp_path, "b", mock_url, pg_url, **sections))


def stalled(**extra: Any) -> dict[str, Any]:
    """A streamed request whose upstream stalls after its first chunk (held until the client leaves)."""
    return completion_body(stream=True, mock={"fail": "stall", "after": 1}, **extra)


async def open_stream(session: aiohttp.ClientSession, url: str, body: dict, key: str = KEY):
    """POST and return the response once its status is in (the caller reads or closes it)."""
    resp = await session.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
    if resp.status == 200:
        await resp.content.readline()  # the first event is through: the request is in flight upstream
    return resp


class Ledger:
    """The shared tables, read with asyncpg."""

    def __init__(self, url: str):
        self.url = url
        self.conn: asyncpg.Connection | None = None

    async def __aenter__(self) -> "Ledger":
        self.conn = await asyncpg.connect(self.url)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.conn.close()

    async def rows(self, **where: Any) -> list[dict[str, Any]]:
        sql = "SELECT * FROM usage_events"
        if where:
            sql += " WHERE " + " AND ".join(f"{k} = ${i}" for i, k in enumerate(where, 1))
        return [dict(r) for r in await self.conn.fetch(sql + " ORDER BY rowid", *where.values())]

    async def settled(self, *ids: str, timeout: float = 10.0) -> list[dict[str, Any]]:
        """The rows of ``ids``, waited for: the row of a request a replica served alone is settled just
        after its response ended (it was in the replica's row journal first)."""
        async with asyncio.timeout(timeout):
            while len(found := await self.conn.fetch("SELECT * FROM usage_events WHERE id = ANY($1::text[])"
                                                     " ORDER BY rowid", list(ids))) < len(ids):
                await asyncio.sleep(0.005)
        return [dict(r) for r in found]

    async def holds(self) -> list[dict[str, Any]]:
        return [dict(r) for r in await self.conn.fetch("SELECT * FROM kiln_holds")]

    async def spent(self) -> dict[str, float]:
        return dict(await self.conn.fetch("SELECT org, spent FROM kiln_orgs"))

    async def sums(self) -> dict[str, float]:
        return dict(await self.conn.fetch("SELECT org, SUM(cost) FROM usage_events GROUP BY org"))

    async def consistent(self) -> bool:
        """Every org's spending equals the SUM(cost) of its rows (to the last bit of rounding), and the
        spend rollup (``usage_daily``) holds exactly the counts and sums of the rows."""
        spent, sums = await self.spent(), await self.sums()
        return all(abs(spent.get(org, 0.0) - total) <= 1e-9 for org, total in sums.items()) and (
            await self.rollup_in_step())

    async def rollup_in_step(self) -> bool:
        rollup = await self.conn.fetch(
            "SELECT day, org, key_id, model, requests, prompt_tokens, completion_tokens, cached_tokens, cost_units"
            " FROM usage_daily WHERE requests <> 0 ORDER BY 1, 2, 3, 4")
        rows = await self.conn.fetch(
            "SELECT substr(created_at, 1, 10), org, key_id, coalesce(model, ''), count(*), sum(prompt_tokens),"
            " sum(completion_tokens), sum(cached_tokens), sum(round(cost * 10000000000)::NUMERIC)"
            " FROM usage_events GROUP BY 1, 2, 3, 4 ORDER BY 1, 2, 3, 4")
        return [tuple(r) for r in rollup] == [tuple(int(v) if i > 3 else v for i, v in enumerate(r)) for r in rows]


async def stop_all(*processes) -> None:
    await asyncio.gather(*(p.stop() for p in processes if p is not None))
