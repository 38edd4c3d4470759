"""Runtime keys for M1 and M2: a gateway's SQLite file filled with ``n`` keys made the way the admin API
and ``kilnproxy keys create`` make them (``TenancyStore.create_key``), before the gateway starts on it.

    secret = make_keys(Path("kilnproxy-runtime-keys.db"), "bench", 10_000)
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from kilnproxy.store.sqlite.schema import prepare_file
from kilnproxy.store.tenancy.orgs_keys import TenancyStore
from kilnproxy.store.tenancy.sql import SQLiteDb


def make_keys(path: Path, org: str, n: int) -> str:
    """Create the file at ``path`` with ``n`` runtime keys of ``org`` (an org of the config); the secret of
    the middle one (every key is found the same way: by its SHA-256 in the gateway's memory)."""
    return asyncio.run(_make_keys(path, org, n))


async def _make_keys(path: Path, org: str, n: int) -> str:
    await asyncio.to_thread(prepare_file, path)
    db = SQLiteDb(path)
    await db.open()
    try:
        # the bench's own throwaway file: no fsync per key (10,000 of them take minutes with one each);
        # the gateway opens it afterwards with its own settings
        await db.fetch("PRAGMA synchronous=OFF")
        store = TenancyStore(db)
        chosen = ""
        for i in range(n):
            secret, _ = await store.create_key(org, f"bench-{i:05d}")
            if i == n // 2:
                chosen = secret
    finally:
        await db.close()
    return chosen
