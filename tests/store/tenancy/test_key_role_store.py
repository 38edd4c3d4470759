"""A key's ``role`` in the store: the SQLite file of the release before (its tenancy tables, schema version 1)
and a PostgreSQL database before version 14 take the column in place, their keys members; the column holds
only ``admin`` or ``member``; and the store keeps an org's last active admin key from a change that passes
``admins_outside`` (an org admin's), not from one that does not (the operator's), nothing changed when refused.
"""

import sqlite3

import asyncpg
import pytest

from kilnproxy.errors import GatewayError
from kilnproxy.store.postgres import schema as pg_schema
from kilnproxy.store.postgres.migrations.v14 import V14
from kilnproxy.store.tenancy.orgs_keys import TenancyStore
from kilnproxy.store.tenancy.sql import SQLITE_MIGRATIONS, PostgresDb, SQLiteDb

USAGE_EVENTS = ("CREATE TABLE usage_events (id TEXT PRIMARY KEY, created_at TEXT NOT NULL, org TEXT NOT NULL, "
                "key_id TEXT NOT NULL, endpoint TEXT NOT NULL, stream INTEGER NOT NULL, status INTEGER NOT NULL, "
                "cost REAL NOT NULL DEFAULT 0)")
OLD_KEY = ("INSERT INTO kiln_keys (id, sha256, prefix, name, org, disabled, created_at) "
           "VALUES ('key_old', 'aa', 'sk-old00', 'old', 'acme', 0, '2026-11-01T00:00:00.000+00:00')")
ROLE_OWNER = "UPDATE kiln_keys SET role = 'owner' WHERE id = 'key_old'"


def sqlite_file_of_schema_1(path):
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute(USAGE_EVENTS)
    for statement in SQLITE_MIGRATIONS[0].split(";"):
        if statement.strip():
            conn.execute(statement)
    conn.execute("PRAGMA user_version = 1")
    conn.execute(OLD_KEY)
    conn.close()
    return path


async def test_an_sqlite_file_of_schema_1_takes_the_role_its_keys_members(tmp_path):
    path = sqlite_file_of_schema_1(tmp_path / "old.db")
    db = SQLiteDb(path)
    await db.open()
    try:
        store = TenancyStore(db)
        assert (await store.get_key("key_old"))["role"] == "member"
        _, made = await store.create_key("acme", "boss", role="admin")
        assert made["role"] == "admin"
        with pytest.raises(sqlite3.IntegrityError):
            await db.fetch(ROLE_OWNER)
    finally:
        await db.close()
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == len(SQLITE_MIGRATIONS)
    conn.close()


async def test_a_postgresql_database_before_version_14_takes_the_role_its_keys_members(pg_url):
    conn = await asyncpg.connect(pg_url)
    try:
        before = pg_schema.MIGRATIONS.index(V14)
        await conn.execute("CREATE TABLE kiln_schema (version INTEGER NOT NULL)")
        for version in range(before):
            async with conn.transaction():
                await conn.execute(pg_schema.MIGRATIONS[version])
                await conn.execute("INSERT INTO kiln_schema (version) VALUES ($1)", version + 1)
        await conn.execute(OLD_KEY)
        assert await pg_schema.migrate(conn) == before
        store = TenancyStore(PostgresDb(conn))
        assert (await store.get_key("key_old"))["role"] == "member"
        with pytest.raises(asyncpg.CheckViolationError):
            await conn.execute(ROLE_OWNER)
    finally:
        await conn.close()


@pytest.fixture(params=["sqlite", "postgresql"])
async def store(request, tmp_path):
    if request.param == "sqlite":
        path = tmp_path / "kilnproxy.db"
        conn = sqlite3.connect(path, isolation_level=None)
        conn.execute(USAGE_EVENTS)
        conn.close()
        db = SQLiteDb(path)
        await db.open()
        yield TenancyStore(db)
        await db.close()
    else:
        conn = await asyncpg.connect(request.getfixturevalue("pg_url"))
        await pg_schema.migrate(conn)
        yield TenancyStore(PostgresDb(conn))
        await conn.close()


async def test_the_last_active_admin_is_kept_from_an_org_admins_change_only(store):
    _, boss = await store.create_key("acme", "boss", role="admin")
    _, member = await store.create_key("acme", "member")
    _, other = await store.create_key("globex", "other", role="admin")  # another org's admin counts for nothing
    version = await store.version()
    for change in ({"role": "member"}, {"disabled": True}, {"expires_at": "2000-01-01T00:00:00.000+00:00"}):
        with pytest.raises(GatewayError) as refused:
            await store.update_key(boss["id"], change, actor="key:x", admins_outside=0)
        assert (refused.value.status, refused.value.code) == (409, "conflict"), change
    with pytest.raises(GatewayError):
        await store.revoke_key(boss["id"], actor="key:x", admins_outside=0)
    assert (await store.get_key(boss["id"]), await store.version()) == (boss, version)  # nothing changed

    # changes that leave it an active admin, or of a member, go through
    assert (await store.update_key(boss["id"], {"name": "chief"}, admins_outside=0))["name"] == "chief"
    assert (await store.revoke_key(member["id"], admins_outside=0))["revoked"]
    # an admin key in the config counts
    assert (await store.update_key(boss["id"], {"role": "member"}, admins_outside=1))["role"] == "member"
    await store.update_key(boss["id"], {"role": "admin"})
    # the operator's changes pass no admins_outside: allowed
    assert (await store.update_key(boss["id"], {"disabled": True}))["disabled"] is True
    assert (await store.revoke_key(other["id"]))["revoked"]
