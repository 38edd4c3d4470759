"""``python -m kilnproxy usage``: totals by org and model, read from the ledger.

Reads the SQLite file read-only, so it works while the gateway runs; with
``[storage] url`` in the config, the PostgreSQL database every replica
writes to, with the same query and the same output.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

from ..config import load_config
from ..errors import KilnError
from ..store.reads import fetch

FIELDS = ("org", "model", "requests", "errors", "prompt_tokens", "completion_tokens", "cached_tokens",
          "total_tokens", "cost")


def add_usage_command(sub, config_arg) -> None:
    p = sub.add_parser("usage", help="print usage totals by org and model")
    config_arg(p)
    p.add_argument("--db", help="the SQLite file (default: the config's [storage] url or path, or ./kilnproxy.db)")
    p.add_argument("--since", help="only requests at or after this date/time (ISO-8601, UTC)")
    p.add_argument("--org", help="only this org")
    p.add_argument("--model", help="only this model")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_usage)


def _since(value: str) -> str:
    """``value`` (naive: UTC) in the ledger's own UTC format; a KilnError if it is not an ISO-8601
    date or time, or falls outside the years 1 to 9999 in UTC."""
    try:
        when = datetime.fromisoformat(value)
    except ValueError:
        raise KilnError(f"--since {value!r}: not a date; use e.g. 2026-11-01 or 2026-11-01T12:00") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    try:
        return when.astimezone(timezone.utc).isoformat(timespec="milliseconds")
    except OverflowError:
        raise KilnError(f"--since {value!r}: out of range (in UTC it falls outside the years 1 to 9999)") from None


def totals(db: Path, since: str | None = None, org: str | None = None, model: str | None = None,
           url: str | None = None) -> list[dict]:
    """Sums per org and model, ordered by them, from PostgreSQL at ``url`` if given, else from ``db``.
    The casts keep PostgreSQL's sums of BIGINT columns integers (not NUMERIC), as SQLite's are;
    the order is Python's (code points), as text order and NULLs' place differ between the two."""
    where, params = [], []
    if since:
        where.append("created_at >= ?")
        params.append(_since(since))
    if org:
        where.append("org = ?")
        params.append(org)
    if model:
        where.append("model = ?")
        params.append(model)
    sql = ("SELECT org, COALESCE(model, '') AS model, COUNT(*) AS requests,"
           " SUM(CASE WHEN status >= 400 OR error_code IS NOT NULL THEN 1 ELSE 0 END) AS errors,"
           " CAST(SUM(prompt_tokens) AS BIGINT) AS prompt_tokens,"
           " CAST(SUM(completion_tokens) AS BIGINT) AS completion_tokens,"
           " CAST(SUM(cached_tokens) AS BIGINT) AS cached_tokens,"
           " CAST(SUM(total_tokens) AS BIGINT) AS total_tokens, SUM(cost) AS cost"
           " FROM usage_events" + (" WHERE " + " AND ".join(where) if where else "") +
           " GROUP BY org, COALESCE(model, '')")
    return sorted(fetch(url, db, sql, params), key=lambda r: (r["org"], r["model"]))


def cmd_usage(args) -> int:
    url = None
    if args.db:
        db = Path(args.db)
    elif args.config:
        config = load_config(args.config)
        db, url = config.db_path, config.storage.url
    else:
        db = Path("kilnproxy.db")
    rows = totals(db, args.since, args.org, args.model, url=url)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(render_table(rows))
    return 0


def render_table(rows: list[dict]) -> str:
    header = ("org", "model", "requests", "errors", "prompt", "completion", "cached", "total", "cost (USD)")
    body = [(r["org"], r["model"], str(r["requests"]), str(r["errors"]), str(r["prompt_tokens"]),
             str(r["completion_tokens"]), str(r["cached_tokens"]), str(r["total_tokens"]), f"{r['cost']:.6f}")
            for r in rows]
    if not body:
        return "no usage recorded"
    if len(body) > 1:
        sums = [str(sum(r[f] or 0 for r in rows)) for f in FIELDS[2:-1]]
        body.append(("total", "", *sums, f"{sum(r['cost'] or 0 for r in rows):.6f}"))
    widths = [max(len(c) for c in col) for col in zip(header, *body)]
    lines = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in (header, *body)]
    return "\n".join(lines)
