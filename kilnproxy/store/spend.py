"""Spend: the usage rows summed by day, model, key and org over a span of time, on either store.

``parse_spend`` reads a query's parameters (``from``, ``to``, ``group_by``, ``org``) and refuses a bad
one naming it (``BadSpendQuery``); ``statement`` writes the one SQL statement (``?`` placeholders,
the same text on SQLite and PostgreSQL) that answers it; ``answer_rows`` turns what it returns
into the answer's rows; ``csv_bytes`` writes them as CSV.

Where the figures come from: ``usage_daily``, a rollup kept beside the rows, one row per
``(day, org, key_id, model)`` with the count of rows and the sums of their tokens and cost. The
store's triggers keep it in step with ``usage_events`` on every write (an insert, a row replaced,
an update, a delete), whichever program writes, in the same transaction
(``kilnproxy.store.sqlite.spend_rollup``, ``kilnproxy.store.postgres.migrations.v15``). A span's
whole days are read from the rollup; a day the span covers in part (``from`` or ``to`` a time, not
midnight) is read from its rows, through the ``(org, created_at)`` index.

Exact figures: every cost is rounded to ``COST_DECIMALS`` (10) decimals where it is computed, so
each row's cost is a whole number of ten-billionths of a dollar; the rollup and the rows both count
cost in those units (``round(cost * 1e10)``, an integer), and integers add up exactly in any order.
The answer's ``cost`` is that integer sum divided by 10**10: the double nearest to the exact sum of
the rows' costs, however the rows are grouped or read. A ``model`` the rows leave empty (NULL or
"") is ``None`` in the answer.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from datetime import date, datetime, timedelta, timezone
from decimal import Decimal
from typing import Any, Mapping

from ..usage import COST_DECIMALS

COST_UNITS = 10 ** COST_DECIMALS  # ten-billionths of a dollar in one
DEFAULT_SPAN = timedelta(days=30)
# group_by's values and the field each adds to the answer, in the order the answer lists them
GROUP_FIELDS = {"day": "day", "model": "model", "key": "key_id", "org": "org"}
SUMS = ("requests", "prompt_tokens", "completion_tokens", "cached_tokens", "cost")
# the cost of one row in whole ten-billionths of a dollar: the triggers' expression, and the rows' here
ROW_COST_UNITS = "CAST(round(cost * 10000000000) AS BIGINT)"


class BadSpendQuery(ValueError):
    """A parameter of a spend query that is not valid: ``param`` names it."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SpendQuery:
    """The rows of ``org`` (every org's when None) created in ``[start, end)``, summed per ``group_by``."""

    start: datetime
    end: datetime
    group_by: tuple[str, ...] = ()
    org: str | None = None

    @property
    def fields(self) -> tuple[str, ...]:
        """The answer's fields, in order: the group's, then the sums."""
        return tuple(GROUP_FIELDS[g] for g in self.group_by) + SUMS


def parse_spend(params: Mapping[str, str], org_scoped: bool, now: datetime | None = None) -> SpendQuery:
    """A ``SpendQuery`` from the parameters ``from``, ``to``, ``group_by`` and (``org_scoped`` false:
    the operator's) ``org``; ``BadSpendQuery`` naming the first one that is not valid. ``org_scoped``
    (an org's own query, its org given separately) refuses ``org`` as a parameter and a group."""
    if org_scoped and "org" in params:
        raise BadSpendQuery("`org` is not a parameter here: this answer is of the key's own org.", "org")
    group_by = parse_group_by(params.get("group_by", ""), org_scoped)
    end = parse_time(params["to"], "to") if "to" in params else (now or datetime.now(timezone.utc))
    if "from" in params:
        start = parse_time(params["from"], "from")
    else:
        try:
            start = end - DEFAULT_SPAN
        except OverflowError:
            raise BadSpendQuery("`to` leaves no room for the default span of 30 days before it; give `from`.",
                                "to") from None
    if start > end:
        raise BadSpendQuery("`from` must not be after `to`.", "from")
    org = params.get("org") or None
    return SpendQuery(start, end, group_by, org)


def parse_group_by(text: str, org_scoped: bool) -> tuple[str, ...]:
    """``day,model`` -> ``("day", "model")``; empty: no group (one row of totals)."""
    if text == "":
        return ()
    allowed = ("day", "model", "key") if org_scoped else ("day", "model", "key", "org")
    groups = tuple(part.strip() for part in text.split(","))
    for group in groups:
        if group not in allowed:
            raise BadSpendQuery(f"`group_by` takes a comma-separated list of {', '.join(allowed)}; "
                                f"not {group!r}.", "group_by")
    if len(set(groups)) < len(groups):
        raise BadSpendQuery("`group_by` names a group twice.", "group_by")
    return groups


def parse_time(text: str, param: str) -> datetime:
    """An ISO-8601 date (midnight) or time, UTC unless it gives an offset, as an aware UTC datetime."""
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise BadSpendQuery(f"`{param}` must be an ISO-8601 date or time (UTC), e.g. 2026-11-01 or "
                            f"2026-11-01T12:00:00Z; not {text[:64]!r}.", param) from None
    if when.tzinfo is None:
        return when.replace(tzinfo=timezone.utc)
    try:
        return when.astimezone(timezone.utc)
    except OverflowError:
        raise BadSpendQuery(f"`{param}` falls outside the years 1 to 9999 in UTC.", param) from None


def stamp(when: datetime) -> str:
    """``when`` as the rows' ``created_at`` text, rounded up to the millisecond (the rows' precision):
    a row is at or after ``when`` exactly when its text is at or after this one."""
    if when.microsecond % 1000:
        try:
            when += timedelta(microseconds=1000 - when.microsecond % 1000)
        except OverflowError:
            return "9999-12-31T23:59:59.999+00:00~"  # after every row
    return when.isoformat(timespec="milliseconds")


def _is_midnight(when: datetime) -> bool:
    return when.hour == when.minute == when.second == when.microsecond == 0


def _day_start(day) -> datetime:
    return datetime.combine(day, datetime.min.time(), timezone.utc)


def statement(q: SpendQuery, rollup: bool = True) -> tuple[str, list[Any]]:
    """The SQL (``?`` placeholders) and its parameters: one row per group with ``requests``, the
    token sums and ``cost_units`` (integers), the group's columns named as in ``GROUP_FIELDS``.
    ``rollup`` false: every row of the span read from ``usage_events`` (a file made before the rollup
    existed, read by a command that does not write it; the bench's baseline)."""
    try:
        first_day = q.start.date() if _is_midnight(q.start) else q.start.date() + timedelta(days=1)
    except OverflowError:  # a time on 9999-12-31: no whole day after it
        first_day = date.max
    end_day = q.end.date()
    parts: list[str] = []
    params: list[Any] = []
    if rollup and first_day < end_day:  # whole days: the rollup
        where = "day >= ? AND day < ?" + (" AND org = ?" if q.org else "")
        parts.append("SELECT day, org, key_id, model, requests, prompt_tokens, completion_tokens, cached_tokens,"
                     f" cost_units FROM usage_daily WHERE {where}")
        params += [first_day.isoformat(), end_day.isoformat()] + ([q.org] if q.org else [])
        edges = []
        if q.start.date() < first_day:
            edges.append((q.start, _day_start(first_day)))
        if not _is_midnight(q.end):
            edges.append((_day_start(end_day), q.end))
    else:  # within a day, or from a time to the next midnight, or no rollup: the rows alone
        edges = [(q.start, q.end)] if q.start < q.end else []
    for start, end in edges:
        if q.org:
            which, which_params = "org = ? AND ", [q.org]
        elif rollup:  # the orgs with rows on those days, so that the (org, created_at) index serves
            which = "org IN (SELECT DISTINCT org FROM usage_daily WHERE day >= ? AND day <= ?) AND "
            which_params = [start.date().isoformat(), end.date().isoformat()]
        else:
            which, which_params = "", []
        parts.append("SELECT substr(created_at, 1, 10) AS day, org, key_id, coalesce(model, '') AS model,"
                     " 1 AS requests, prompt_tokens, completion_tokens, cached_tokens,"
                     f" {ROW_COST_UNITS} AS cost_units FROM usage_events"
                     f" WHERE {which}created_at >= ? AND created_at < ?")
        params += which_params + [stamp(start), stamp(end)]
    groups = [GROUP_FIELDS[g] for g in q.group_by]  # a column of the rollup and of the rows as read
    sums = ("SUM(requests) AS requests, SUM(prompt_tokens) AS prompt_tokens,"  # PostgreSQL: NUMERIC, read as ints
            " SUM(completion_tokens) AS completion_tokens, SUM(cached_tokens) AS cached_tokens,"
            " SUM(cost_units) AS cost_units")
    group_by = f" GROUP BY {', '.join(groups)}" if q.group_by else ""
    if not parts:  # an empty span: no row
        parts = ["SELECT '' AS day, '' AS org, '' AS key_id, '' AS model, 0 AS requests, 0 AS prompt_tokens,"
                 " 0 AS completion_tokens, 0 AS cached_tokens, 0 AS cost_units WHERE 1 = 0"]
    return f"SELECT {', '.join(groups + [sums])} FROM ({' UNION ALL '.join(parts)}) AS spend{group_by}", params


def answer_rows(q: SpendQuery, found: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The answer's rows from ``statement``'s: the fields in order, ``cost`` in dollars, groups of no
    request left out, ordered by the group's fields (code points; no model first); no group: one row
    of totals (zeros when no row)."""
    rows = []
    for r in found:
        if not r["requests"]:
            continue
        row = {}
        for g in q.group_by:
            value = r[GROUP_FIELDS[g]]
            row[GROUP_FIELDS[g]] = (value or None) if g == "model" else value
        row.update(requests=int(r["requests"]), prompt_tokens=int(r["prompt_tokens"]),
                   completion_tokens=int(r["completion_tokens"]), cached_tokens=int(r["cached_tokens"]),
                   cost=int(r["cost_units"]) / COST_UNITS)
        rows.append(row)
    if not q.group_by:
        return rows or [dict(requests=0, prompt_tokens=0, completion_tokens=0, cached_tokens=0, cost=0.0)]
    keys = [GROUP_FIELDS[g] for g in q.group_by]
    rows.sort(key=lambda row: [(row[k] is not None, row[k] or "") for k in keys])
    return rows


def cost_text(cost: float) -> str:
    """A cost as the exact decimal it stands for, without exponent: 1.6e-06 -> ``0.0000016``."""
    text = format(Decimal(round(cost * COST_UNITS)) / COST_UNITS, "f")
    return text.rstrip("0").rstrip(".") if "." in text else text


def csv_bytes(q: SpendQuery, rows: list[dict[str, Any]]) -> bytes:
    """The rows as CSV (RFC 4180, CRLF): a header line of the fields, then a line per row; no model is
    an empty field, a cost its exact decimal."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\r\n")
    writer.writerow(q.fields)
    for row in rows:
        writer.writerow([cost_text(row[f]) if f == "cost" else ("" if row[f] is None else row[f])
                         for f in q.fields])
    return out.getvalue().encode()
