"""``python -m kilnproxy import-ledger FILE.db --config CONFIG``: an SQLite ledger into PostgreSQL.

For a team that outgrows one process and keeps its history (several replicas (docs/reference.md)). The
rows are read from the file (read-only, oldest first, in batches) and each
batch is settled exactly as a gateway settles its own rows, by the store's
``kiln_settle``: the rows are inserted and their cost added to their orgs'
spending in one transaction, and a row whose id is already there is skipped.
So spending moves with the rows, an import can run while replicas serve, and a
second run (or a run again after an interruption) adds nothing twice.

Bad input is one line and exit status 2 (``KilnError``): a missing file, a
file that is not a kilnproxy ledger, a row holding text that is not UTF-8
(refused, not imported with its bytes replaced: a changed org or id would
charge another org or break the skipping of rows already there), a config
without ``[storage] url``, a database out of reach (its URL shown without the
password).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sqlite3
import sys
from pathlib import Path
from typing import Any, Iterator

import orjson

from ..config import load_config
from ..errors import KilnError, StorageError
from ..store.reads import pg_close, pg_connect, reason
from ..store.sqlite.schema import ADDED_COLUMNS
from ..usage import COLUMNS

BATCH_ROWS = 1000  # rows per kiln_settle call: one transaction, about 400 kB of JSON
REPLICA = "import-ledger"  # the ``replica`` column of imported rows: where they came from


def add_import_command(sub) -> None:
    p = sub.add_parser("import-ledger", help="copy an SQLite ledger's rows into the PostgreSQL database "
                                             "of the config's [storage] url")
    p.add_argument("file", help="the SQLite ledger (the [storage] path of a single-process gateway)")
    p.add_argument("--config", default=os.environ.get("KILNPROXY_CONFIG"),
                   help="the TOML config whose [storage] url names the database (default: $KILNPROXY_CONFIG)")
    p.add_argument("--batch", type=_positive, default=BATCH_ROWS, metavar="ROWS",
                   help=f"rows per transaction (default {BATCH_ROWS})")
    p.add_argument("--progress", action="store_true",
                   help="show a progress bar even when stderr is not a terminal")
    p.set_defaults(func=cmd_import)


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of rows, 1 or more, not {text!r}")
    return int(text)


def cmd_import(args) -> int:
    if not args.config:
        raise KilnError("import-ledger needs --config: the config whose [storage] url names the database")
    url = load_config(args.config).storage.url
    if not url:
        raise KilnError(f"{args.config}: no [storage] url (or url_env): import-ledger copies into the"
                        " PostgreSQL database a config names, e.g. url = \"postgresql://user:pass@host/db\"")
    source = SQLiteSource(Path(args.file))
    show = args.progress or (sys.stderr.isatty() and source.count > args.batch)
    try:
        added, present = asyncio.run(import_rows(source, url, args.batch, show))
    finally:
        source.close()
    from ..store.postgres.connection import redacted
    print(f"imported {added} rows from {source.path} into {redacted(url)}"
          f" ({present} already there)")
    return 0


class SQLiteSource:
    """The ledger file, opened read-only and checked to be a kilnproxy ledger."""

    def __init__(self, path: Path):
        self.path = path
        if not path.is_file():
            raise StorageError(f"no such file: {str(path)!r} (give the [storage] path of the gateway's ledger)")
        self.db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5.0)
        try:
            self.db.row_factory = sqlite3.Row
            columns = {r["name"] for r in self.db.execute("PRAGMA table_info(usage_events)")}
            if not columns:
                raise self._not_a_ledger("it has no usage_events table")
            added = {name for name, _, _ in ADDED_COLUMNS}
            if missing := [c for c in COLUMNS if c not in columns and c not in added]:
                raise self._not_a_ledger(f"its usage_events table lacks {', '.join(missing)}")
            # a ledger of an older kilnproxy: a column added since is filled as opening it would fill it
            filled = {name: source for name, _, source in ADDED_COLUMNS}
            self.select = ", ".join(c if c in columns else f"{filled[c]} AS {c}" for c in COLUMNS)
            self.count = self.db.execute("SELECT count(*) FROM usage_events").fetchone()[0]
        except sqlite3.DatabaseError as exc:
            self.db.close()
            raise self._not_a_ledger(str(exc)) from None
        except BaseException:
            self.db.close()
            raise

    def _not_a_ledger(self, why: str) -> StorageError:
        return StorageError(f"{str(self.path)!r} is not a kilnproxy ledger: {why}")

    def batches(self, size: int) -> Iterator[list[dict[str, Any]]]:
        """The rows, oldest first (by rowid), ``size`` at a time; never the whole file in memory.
        A batch that cannot be read is a ``StorageError`` naming the row and column whose text is
        not UTF-8, or else SQLite's reason."""
        sql = f"SELECT rowid AS _rowid, {self.select} FROM usage_events WHERE rowid > ? ORDER BY rowid LIMIT ?"
        last = -1
        while rows := self._read(sql, (last, size)):
            last = rows[-1]["_rowid"]
            yield [{c: r[c] for c in COLUMNS} for r in rows]

    def _read(self, sql: str, params: tuple) -> list[sqlite3.Row]:
        try:
            return self.db.execute(sql, params).fetchall()
        except sqlite3.Error as exc:
            raise self._not_utf8(sql, params) or StorageError(f"cannot read {str(self.path)!r}: {exc}") from None

    def _not_utf8(self, sql: str, params: tuple) -> StorageError | None:
        """The error naming the first row and column of this batch whose text is not UTF-8, if any."""
        self.db.text_factory = bytes
        try:
            for row in self.db.execute(sql, params):
                for column in COLUMNS:
                    if isinstance(row[column], bytes) and not _is_utf8(row[column]):
                        return StorageError(f"row {row['_rowid']} of {str(self.path)!r} holds text that is not"
                                            f" UTF-8 in its {column} column: correct or delete that row")
            return None
        finally:
            self.db.text_factory = str

    def close(self) -> None:
        self.db.close()


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True


async def import_rows(source: SQLiteSource, url: str, batch: int, show_progress: bool) -> tuple[int, int]:
    """Settle every row of ``source`` in the database at ``url``; returns (rows added, rows already there)."""
    import asyncpg
    from tqdm import tqdm

    from ..store.postgres.connection import redacted
    from ..store.postgres.schema import migrate
    conn = await pg_connect(url)
    added = present = 0
    done_until = None
    try:
        await migrate(conn)  # a database no gateway has used yet gets its schema first
        with tqdm(total=source.count, unit="rows", unit_scale=True, disable=not show_progress,
                  file=sys.stderr, desc="import-ledger") as bar:
            for rows in source.batches(batch):
                ids = [r["id"] for r in rows]
                found = await conn.fetchval("SELECT count(*) FROM usage_events WHERE id = ANY($1::text[])", ids)
                await conn.execute("SELECT FROM kiln_settle($1::jsonb, $2)", orjson.dumps(rows).decode(), REPLICA)
                present += found
                added += len(rows) - found
                done_until = ids[-1]
                bar.update(len(rows))
    except (OSError, asyncio.TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        where = f"after row {done_until}" if done_until else "at the first row"
        raise StorageError(f"import into {redacted(url)} stopped {where} ({added} rows added): "
                           f"{reason(exc, url)}; run it again to go on (rows already there are skipped)") from None
    except StorageError as exc:
        where = f"after row {done_until}" if done_until else "at the first row"
        raise StorageError(f"import into {redacted(url)} stopped {where} ({added} rows added): {exc},"
                           " then run it again (rows already there are skipped)") from None
    finally:
        await pg_close(conn)  # nothing to commit: every batch was its own transaction
    return added, present
