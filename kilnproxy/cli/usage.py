"""``python -m kilnproxy usage``: totals by org and model, read from the ledger; with ``--from``, ``--to``,
``--group-by`` or ``--csv``, the spend query of ``GET /admin/v1/usage`` (``kilnproxy.store.spend``).

Reads the SQLite file read-only, so it works while the gateway runs; with
``[storage] url`` in the config, the PostgreSQL database every replica
writes to, with the same query and the same output. The spend query reads the
rollup kept beside the rows; a file or database no gateway of this version has
opened yet has none, and is answered from its rows, with the same figures.
"""

from __future__ import annotations

import json
import sys
from datetime import datetime, timezone
from pathlib import Path

from ..config import load_config
from ..errors import KilnError
from ..store.reads import fetch
from ..store.spend import BadSpendQuery, SpendQuery, answer_rows, cost_text, csv_bytes, parse_spend, statement

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
    p.add_argument("--from", dest="start", metavar="WHEN",
                   help="spend from this date/time, inclusive (ISO-8601, UTC; default: 30 days before --to)")
    p.add_argument("--to", dest="end", metavar="WHEN", help="spend up to this date/time, exclusive (default: now)")
    p.add_argument("--group-by", metavar="GROUPS",
                   help="spend by a comma-separated list of day, model, key, org (default: one line of totals)")
    p.add_argument("--csv", action="store_true", help="print the spend as CSV, the same as GET /admin/v1/usage's")
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
    if args.start is not None or args.end is not None or args.group_by is not None or args.csv:
        return print_spend(args, db, url)
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


def spend_query(args) -> SpendQuery:
    """The spend query of the command's options; a ``KilnError`` naming the option that is not valid."""
    for option, value in (("--since", args.since), ("--model", args.model)):
        if value is not None:
            raise KilnError(f"{option} is not an option of the spend query (--from, --to, --group-by, --org, --csv)")
    if args.csv and args.json:
        raise KilnError("--csv or --json, not both")
    params = {name: value for name, value in (("from", args.start), ("to", args.end), ("group_by", args.group_by),
                                              ("org", args.org)) if value is not None}
    try:
        return parse_spend(params, org_scoped=False)
    except BadSpendQuery as exc:
        option = {"from": "--from", "to": "--to", "group_by": "--group-by"}.get(exc.param, exc.param)
        raise KilnError(f"{option} {params.get(exc.param, '')!r}: {exc}") from None


def spend(db: Path, q: SpendQuery, url: str | None = None) -> list[dict]:
    """The answer's rows from PostgreSQL at ``url`` if given, else from the SQLite file ``db``: from the
    rollup when the store has one, else from the rows."""
    probe = ("SELECT count(*) AS n FROM pg_class WHERE relname = 'usage_daily'" if url else
             "SELECT count(*) AS n FROM sqlite_master WHERE type = 'table' AND name = 'usage_daily'")
    rollup = bool(fetch(url, db, probe)[0]["n"])
    sql, params = statement(q, rollup)
    return answer_rows(q, fetch(url, db, sql, params))


def print_spend(args, db: Path, url: str | None) -> int:
    q = spend_query(args)
    rows = spend(db, q, url)
    if args.csv:
        sys.stdout.buffer.write(csv_bytes(q, rows))
    elif args.json:
        print(json.dumps({"data": rows}, indent=2))
    else:
        body = [[cost_text(r[f]) if f == "cost" else "" if r[f] is None else str(r[f]) for f in q.fields]
                for r in rows]
        widths = [max(len(c) for c in col) for col in zip(q.fields, *body)]
        groups = len(q.group_by)  # the group's columns left-aligned, the figures right-aligned
        for line in (q.fields, *body):
            print("  ".join(c.ljust(w) if i < groups else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))))
    return 0
