"""The runtime orgs' and keys' ``priority`` and ``weight`` (SPEC 14) reach stores made before them: an SQLite file
at its first version and a PostgreSQL database at version 11, each with an org and a key, are migrated in place;
the org takes ``interactive`` and 1, the key NULL (its org's); both then take the new fields, and the columns refuse
what the API refuses."""

import sqlite3

import asyncpg
import pytest

from kilnproxy.store.postgres import schema as pg_schema
from kilnproxy.store.tenancy.orgs_keys import TenancyStore
from kilnproxy.store.tenancy.sql import SQLITE_MIGRATIONS, SQLiteDb, PostgresDb, migrate_sqlite

OLD_ORG = ("INSERT INTO kiln_runtime_orgs (id, max_in_flight, disabled, created_at) "
           "VALUES ('acme', 4, 0, '2026-12-01T00:00:00.000+00:00')")
OLD_KEY = ("INSERT INTO kiln_keys (id, sha256, prefix, name, org, disabled, created_at) "
           "VALUES ('key_1', 'ab', 'sk-abcde', 'ci', 'acme', 0, '2026-12-01T00:00:00.000+00:00')")


async def check_migrated(store: TenancyStore) -> None:
    org = await store.get_org("acme")
    assert (org["max_in_flight"], org["priority"], org["weight"]) == (4, "interactive", 1.0)
    key = await store.get_key("key_1")
    assert (key["name"], key["priority"], key["weight"]) == ("ci", None, None)
    changed = await store.update_org("acme", {"priority": "batch", "weight": 2.5})
    assert (changed["priority"], changed["weight"]) == ("batch", 2.5)
    changed = await store.update_key("key_1", {"priority": "interactive", "weight": 4.0})
    assert (changed["priority"], changed["weight"]) == ("interactive", 4.0)
    snapshot = await store.snapshot()
    assert (snapshot.orgs["acme"]["priority"], snapshot.keys["ab"]["weight"]) == ("batch", 4.0)


async def test_an_sqlite_file_of_the_first_version_is_migrated_in_place(tmp_path):
    path = tmp_path / "old.db"
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("CREATE TABLE usage_events (id TEXT PRIMARY KEY, key_id TEXT, created_at TEXT)")
    conn.execute("BEGIN")
    for statement in SQLITE_MIGRATIONS[0].split(";"):
        if statement.strip():
            conn.execute(statement)
    conn.execute("PRAGMA user_version = 1")
    conn.execute(OLD_ORG)
    conn.execute(OLD_KEY)
    conn.execute("COMMIT")
    assert migrate_sqlite(conn) == 1
    for bad in ("UPDATE kiln_runtime_orgs SET priority = 'urgent'", "UPDATE kiln_runtime_orgs SET weight = 0",
                "UPDATE kiln_keys SET weight = -1", "UPDATE kiln_keys SET priority = 'low'"):
        with pytest.raises(sqlite3.IntegrityError):
            conn.execute(bad)
    conn.close()
    db = SQLiteDb(path)
    await db.open()
    try:
        await check_migrated(TenancyStore(db))
    finally:
        await db.close()


async def test_a_postgresql_database_at_version_11_is_migrated_in_place(pg_url):
    conn = await asyncpg.connect(pg_url)
    try:
        await conn.execute("CREATE TABLE kiln_schema (version INTEGER NOT NULL)")
        for version in range(11):
            async with conn.transaction():
                await conn.execute(pg_schema.MIGRATIONS[version])
                await conn.execute("INSERT INTO kiln_schema (version) VALUES ($1)", version + 1)
        await conn.execute(OLD_ORG)
        await conn.execute(OLD_KEY)
        assert await pg_schema.migrate(conn) == 11
        assert await conn.fetchval("SELECT max(version) FROM kiln_schema") == len(pg_schema.MIGRATIONS)
        for bad in ("UPDATE kiln_runtime_orgs SET priority = 'urgent'", "UPDATE kiln_runtime_orgs SET weight = 0",
                    "UPDATE kiln_keys SET weight = -1", "UPDATE kiln_keys SET priority = 'low'"):
            with pytest.raises(asyncpg.CheckViolationError):
                await conn.execute(bad)
    finally:
        await conn.close()
    pool = await asyncpg.create_pool(pg_url, min_size=1, max_size=2)
    try:
        await check_migrated(TenancyStore(PostgresDb(pool)))
    finally:
        await pool.close()
