"""A key's usage in its current period: the period's bounds, and the query that sums it.

Periods start at 00:00 UTC: each day (``daily``), each Monday (``weekly``),
the first of each month (``monthly``). A key whose ``limit_reset`` is null
has one period, since it was made. Times are the stores' ISO-8601 text
(``2026-11-30T00:00:00.000+00:00``): the usage of a key in its period is its
rows whose ``created_at`` text is at least the period's start.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any, Iterable, Mapping

from ...usage import round_usd
from .validation import iso_utc


def _utc(now: datetime | None) -> datetime:
    return datetime.now(timezone.utc) if now is None else now.astimezone(timezone.utc)


def period_start(limit_reset: str | None, created_at: str, now: datetime | None = None) -> str:
    """The start of the period ``now`` is in, as text to compare with ``usage_events.created_at``."""
    if limit_reset is None:
        return created_at
    day = _utc(now).replace(hour=0, minute=0, second=0, microsecond=0)
    if limit_reset == "daily":
        return iso_utc(day)
    if limit_reset == "weekly":
        return iso_utc(day - timedelta(days=day.weekday()))
    if limit_reset == "monthly":
        return iso_utc(day.replace(day=1))
    raise ValueError(f"limit_reset must be daily, weekly, monthly or None, not {limit_reset!r}")


def period_end(limit_reset: str | None, now: datetime | None = None) -> str | None:
    """When the period ``now`` is in ends (the next reset), or None for a key never reset."""
    if limit_reset is None:
        return None
    day = _utc(now).replace(hour=0, minute=0, second=0, microsecond=0)
    if limit_reset == "daily":
        return iso_utc(day + timedelta(days=1))
    if limit_reset == "weekly":
        return iso_utc(day + timedelta(days=7 - day.weekday()))
    if limit_reset == "monthly":
        first = day.replace(day=1)
        return iso_utc(first.replace(year=first.year + 1, month=1) if first.month == 12
                       else first.replace(month=first.month + 1))
    raise ValueError(f"limit_reset must be daily, weekly, monthly or None, not {limit_reset!r}")


USAGE_SINCE = "SELECT COALESCE(SUM(cost), 0) AS usage FROM usage_events WHERE key_id = ? AND created_at >= ?"
KEYS_PER_QUERY = 500  # ids in one IN (...) list, well under both stores' parameter limits


async def key_usage(db: Any, key_id: str, since: str) -> float:
    """USD the key spent from ``since`` on (``period_start``): the ``SUM(cost)`` of its rows, on ``db``
    (a ``tenancy_sql.SQLiteDb`` or ``PostgresDb``: the query is the same text on both)."""
    return round_usd(await db.fetchval(USAGE_SINCE, key_id, since) or 0.0)


async def usage_by_key(db: Any, keys: Iterable[Mapping[str, Any]], now: datetime | None = None) -> dict[str, float]:
    """Each key's usage in its period at ``now`` (0.0 for none), by key id: one query for all the keys
    whose period starts at the same moment (every daily key shares one, every monthly key another)."""
    by_start: dict[str, list[str]] = {}
    for key in keys:
        by_start.setdefault(period_start(key["limit_reset"], key["created_at"], now), []).append(key["id"])
    usage: dict[str, float] = {}
    for since, ids in by_start.items():
        for at in range(0, len(ids), KEYS_PER_QUERY):
            part = ids[at:at + KEYS_PER_QUERY]
            usage.update(dict.fromkeys(part, 0.0))
            rows = await db.fetch(
                f"SELECT key_id, SUM(cost) AS usage FROM usage_events WHERE key_id IN "
                f"({', '.join('?' * len(part))}) AND created_at >= ? GROUP BY key_id", *part, since)
            usage.update({r["key_id"]: round_usd(r["usage"]) for r in rows})
    return usage
