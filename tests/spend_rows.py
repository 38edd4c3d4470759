"""Spend tests' helpers: statements on a harness's store (either one), the rows moved in time, the
answer expected from the rows themselves, and the rollup compared with the rows.

``expected(rows, group_by)`` sums the rows in Python, independently of ``kilnproxy.store.spend``:
each cost as the exact decimal of its 10 decimals (``Decimal(repr(cost))``), summed exactly, the
answer's ``cost`` the float of that decimal.
"""

from __future__ import annotations

import sqlite3
from decimal import Decimal
from typing import Any

FIELDS = {"day": "day", "model": "model", "key": "key_id", "org": "org"}
SUMS = ("requests", "prompt_tokens", "completion_tokens", "cached_tokens", "cost")


async def execute(h, sql: str, params: list[Any] = (), fetch: bool = False) -> list[dict[str, Any]]:
    """Run ``sql`` (``?`` placeholders) on the harness's store, as another program would."""
    url = h.gw.config.storage.url
    if url:
        import asyncpg

        from kilnproxy.store.postgres.connection import numbered
        conn = await asyncpg.connect(url)
        try:
            return [dict(r) for r in await conn.fetch(numbered(sql), *params)]
        finally:
            await conn.close()
    db = sqlite3.connect(h.db, timeout=10, isolation_level=None)
    db.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in db.execute(sql, list(params)).fetchall()]
    finally:
        db.close()


async def move(h, times: dict[str, str]) -> None:
    """Give rows (by id) the ``created_at`` of ``times``, one UPDATE each."""
    for row_id, created_at in times.items():
        await execute(h, "UPDATE usage_events SET created_at = ? WHERE id = ?", [created_at, row_id])


def cost_decimal(cost: float) -> Decimal:
    return Decimal(repr(cost))


def expected(rows: list[dict[str, Any]], group_by: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """The answer the spend query should give for exactly these rows."""
    groups: dict[tuple, dict[str, Any]] = {}
    for r in rows:
        values = {"day": r["created_at"][:10], "model": r["model"] or None, "key": r["key_id"], "org": r["org"]}
        key = tuple(values[g] for g in group_by)
        out = groups.setdefault(key, {**{FIELDS[g]: values[g] for g in group_by}, "requests": 0, "prompt_tokens": 0,
                                      "completion_tokens": 0, "cached_tokens": 0, "cost": Decimal(0)})
        out["requests"] += 1
        for f in ("prompt_tokens", "completion_tokens", "cached_tokens"):
            out[f] += r[f]
        out["cost"] += cost_decimal(r["cost"])
    found = [{**g, "cost": float(g["cost"])} for _, g in sorted(
        groups.items(), key=lambda kv: [(v is not None, v or "") for v in kv[0]])]
    if not group_by and not found:
        return [{"requests": 0, "prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0, "cost": 0.0}]
    return found


def csv_text(rows: list[dict[str, Any]], group_by: tuple[str, ...]) -> bytes:
    """The CSV of ``expected``'s rows, written out plainly (no field here needs quoting)."""
    fields = [FIELDS[g] for g in group_by] + list(SUMS)
    lines = [",".join(fields)]
    for r in rows:
        cells = []
        for f in fields:
            if f == "cost":
                text = format(cost_decimal(r[f]), "f")
                cells.append(text.rstrip("0").rstrip(".") if "." in text else text)
            else:
                cells.append("" if r[f] is None else str(r[f]))
        lines.append(",".join(cells))
    return ("\r\n".join(lines) + "\r\n").encode()


async def rollup_and_rows(h) -> tuple[list[dict], list[dict]]:
    """The rollup table as it is, and as the rows say it should be (groups of no row left out)."""
    rollup = await execute(h, "SELECT day, org, key_id, model, requests, prompt_tokens, completion_tokens,"
                              " cached_tokens, cost_units FROM usage_daily WHERE requests <> 0"
                              " ORDER BY day, org, key_id, model")
    rows = await execute(h, "SELECT substr(created_at, 1, 10) AS day, org, key_id, coalesce(model, '') AS model,"
                            " count(*) AS requests, sum(prompt_tokens) AS prompt_tokens,"
                            " sum(completion_tokens) AS completion_tokens, sum(cached_tokens) AS cached_tokens,"
                            " sum(CAST(round(cost * 10000000000) AS BIGINT)) AS cost_units FROM usage_events"
                            " GROUP BY 1, 2, 3, 4 ORDER BY 1, 2, 3, 4")
    return [_figures_as_ints(r) for r in rollup], [_figures_as_ints(r) for r in rows]


def _figures_as_ints(row: dict) -> dict:
    """PostgreSQL's sums of BIGINT are NUMERIC: the figures as ints, the group's columns as they are."""
    return {k: v if k in ("day", "org", "key_id", "model") else int(v) for k, v in row.items()}
