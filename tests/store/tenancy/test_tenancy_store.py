"""The store layer of runtime tenancy: runtime orgs, keys, grants and their audit log, on a real SQLite file and
a real PostgreSQL (every store test runs on both), plus the pure checks of the admin bodies.

``open_store()`` (the ``tenancy`` fixture) gives a new ``TenancyStore`` on its own connection to the
same database, so two of them are two gateways (or a gateway and a command) sharing one store.
"""

import asyncio
import hashlib
import sqlite3
from datetime import datetime

import asyncpg
import pytest

from kilnproxy.errors import GatewayError, StorageError
from kilnproxy.store.postgres import schema as pg_schema
from kilnproxy.store.tenancy import validation as bodies
from kilnproxy.store.tenancy.key_usage import key_usage, period_end, period_start
from kilnproxy.store.tenancy.orgs_keys import TenancyStore
from kilnproxy.store.tenancy.sql import NOTIFY_CHANNEL, SQLITE_MIGRATIONS, PostgresDb, SQLiteDb, migrate_sqlite

# The ledger's usage_events as far as these tests need it (kilnproxy.ledger.SCHEMA has every column).
USAGE_EVENTS = """
CREATE TABLE usage_events (
    id TEXT PRIMARY KEY, created_at TEXT NOT NULL, org TEXT NOT NULL, key_id TEXT NOT NULL, model TEXT,
    endpoint TEXT NOT NULL, stream INTEGER NOT NULL, status INTEGER NOT NULL, error_code TEXT,
    cost REAL NOT NULL DEFAULT 0
)"""
ADD_USAGE = ("INSERT INTO usage_events (id, created_at, org, key_id, endpoint, stream, status, cost) "
             "VALUES (?, ?, ?, ?, 'completions', 1, 200, ?)")


def ledger_file(path):
    """An SQLite file as a gateway before runtime tenancy left it: WAL, usage_events, user_version 0."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute(USAGE_EVENTS)
    conn.close()
    return path


class Stores:
    """Opens ``TenancyStore``s on one database, each on a connection of its own; closes them all."""

    def __init__(self, kind, tmp_path, pg_url):
        self.kind, self.tmp_path, self.pg_url = kind, tmp_path, pg_url
        self.path = tmp_path / "kilnproxy.db"
        self.closers = []

    async def setup(self):
        if self.kind == "sqlite":
            ledger_file(self.path)
        else:
            conn = await asyncpg.connect(self.pg_url)
            await pg_schema.migrate(conn)
            await conn.close()

    async def open(self, clock=None):
        if self.kind == "sqlite":
            db = SQLiteDb(self.path)
            await db.open()
            self.closers.append(db.close)
        else:
            conn = await asyncpg.connect(self.pg_url)
            self.closers.append(conn.close)
            db = PostgresDb(conn)
        return TenancyStore(db, clock) if clock else TenancyStore(db)

    async def close(self):
        for close in self.closers:
            await close()


@pytest.fixture(params=["sqlite", "postgresql"])
async def stores(request, tmp_path):
    pg_url = request.getfixturevalue("pg_url") if request.param == "postgresql" else None
    stores = Stores(request.param, tmp_path, pg_url)
    await stores.setup()
    yield stores
    await stores.close()


@pytest.fixture
async def pg_stores(tmp_path, pg_url):
    """``stores`` on PostgreSQL alone, for what only it does (notifications, a pool)."""
    stores = Stores("postgresql", tmp_path, pg_url)
    await stores.setup()
    yield stores
    await stores.close()


@pytest.fixture
async def store(stores):
    return await stores.open()


def at(text):
    return datetime.fromisoformat(text)


# -- orgs ----------------------------------------------------------------------------------------------

async def test_an_org_is_created_read_listed_and_patched_each_change_one_event(store):
    org = await store.create_org("acme", max_in_flight=4, actor="admin-api")
    assert org == {"id": "acme", "max_in_flight": 4, "disabled": False, "requests_per_minute": None,
                   "tokens_per_minute": None, "priority": "interactive", "weight": 1.0,
                   "created_at": org["created_at"]}
    assert await store.get_org("acme") == org
    await store.create_org("globex")
    assert [o["id"] for o in await store.list_orgs()] == ["acme", "globex"]

    patched = await store.update_org("acme", {"disabled": True, "max_in_flight": 4, "tokens_per_minute": 1000})
    assert (patched["disabled"], patched["max_in_flight"], patched["tokens_per_minute"]) == (True, 4, 1000)
    assert await store.get_org("acme") == patched

    events = await store.list_events()
    assert [(e["id"], e["kind"], e["subject"]) for e in events] == [
        (3, "org.updated", "acme"), (2, "org.created", "globex"), (1, "org.created", "acme")]
    assert events[0]["detail"] == {"from": {"disabled": False, "tokens_per_minute": None},
                                   "to": {"disabled": True, "tokens_per_minute": 1000}}  # max_in_flight: the same
    assert events[2]["actor"] == "admin-api" and events[2]["detail"]["max_in_flight"] == 4
    assert await store.version() == 3


async def test_an_existing_org_id_is_a_conflict_and_changes_nothing(store):
    await store.create_org("acme")
    with pytest.raises(GatewayError) as refused:
        await store.create_org("acme", max_in_flight=2)
    assert (refused.value.status, refused.value.code) == (409, "conflict")
    assert (await store.get_org("acme"))["max_in_flight"] is None
    assert (await store.version(), len(await store.list_events())) == (1, 1)


async def test_patching_nothing_new_or_an_unknown_org_writes_no_event(store):
    await store.create_org("acme", max_in_flight=2)
    assert (await store.update_org("acme", {"max_in_flight": 2}))["max_in_flight"] == 2
    assert await store.update_org("nobody", {"disabled": True}) is None
    assert await store.update_key("key_nobody", {"name": "x"}) is None
    assert await store.revoke_key("key_nobody") is None
    assert await store.version() == 1
    with pytest.raises(ValueError):
        await store.update_org("acme", {"id": "renamed"})


# -- grants --------------------------------------------------------------------------------------------

async def test_a_reference_credits_once_and_a_negative_grant_corrects(store):
    grant, created = await store.add_grant("acme", 10.0, "pay_1")
    assert created and grant["amount"] == 10.0 and grant["id"].startswith("grant_")
    again, created = await store.add_grant("acme", 99.0, "pay_1")  # a retried webhook: the first grant
    assert not created and again == grant
    _, created = await store.add_grant("acme", -2.5, "refund_1")
    assert created
    _, created = await store.add_grant("globex", 1, "pay_1")  # a reference is unique within its org
    assert created
    assert await store.granted_by_org() == {"acme": 7.5, "globex": 1.0}
    assert [(g["amount"], g["reference"]) for g in await store.list_grants("acme")] == [
        (10.0, "pay_1"), (-2.5, "refund_1")]
    assert [e["kind"] for e in await store.list_events()] == ["grant.created"] * 3
    assert (await store.list_events(org="acme"))[0]["detail"] == {"amount": -2.5, "reference": "refund_1"}


async def test_one_reference_posted_at_once_on_two_connections_credits_once(stores):
    one, two = await stores.open(), await stores.open()
    for attempt in range(10):
        results = await asyncio.gather(one.add_grant("acme", 5.0, f"pay_{attempt}"),
                                       two.add_grant("acme", 5.0, f"pay_{attempt}"))
        assert sorted(created for _, created in results) == [False, True]
        assert results[0][0] == results[1][0]
    assert (await one.granted_by_org())["acme"] == 50.0
    assert len(await two.list_grants("acme")) == 10
    assert await one.version() == 10
    assert [e["id"] for e in await two.list_events()] == list(range(10, 0, -1))


async def test_changes_from_two_connections_at_once_take_one_version_each(stores):
    one, two = await stores.open(), await stores.open()
    await asyncio.gather(*(s.add_grant("acme", 1.0, f"ref_{i}") for i in range(20) for s in (one, two)),
                         *(s.create_org(f"org{i}-{n}") for i in range(5) for n, s in enumerate((one, two))))
    assert await one.version() == 30
    assert sorted(e["id"] for e in await two.list_events(limit=100)) == list(range(1, 31))


# -- keys ----------------------------------------------------------------------------------------------

async def test_a_key_secret_is_returned_once_and_only_its_sha256_is_kept(stores, store):
    secret, key = await store.create_key("acme", "ci", models=["m1"], limit=2.0, limit_reset="daily",
                                         expires_at="2027-01-01T00:00:00.000+00:00")
    assert secret.startswith("sk-") and len(secret) > 40
    assert key["prefix"] == secret[:8] and key["id"].startswith("key_")
    assert {k: key[k] for k in ("name", "org", "models", "limit", "limit_reset", "expires_at", "disabled",
                                 "revoked", "revoked_at")} == {
        "name": "ci", "org": "acme", "models": ["m1"], "limit": 2.0, "limit_reset": "daily",
        "expires_at": "2027-01-01T00:00:00.000+00:00", "disabled": False, "revoked": False, "revoked_at": None}
    assert await store.get_key(key["id"]) == key
    snapshot = await store.snapshot()
    assert snapshot.keys[hashlib.sha256(secret.encode()).hexdigest()] == key

    rows = [await store.list_keys(), await store.list_events(), list(snapshot.keys.values())]
    assert secret not in repr(rows) and secret[8:] not in repr(rows)
    event = (await store.list_events())[0]
    assert (event["kind"], event["org"], event["subject"]) == ("key.created", "acme", key["id"])
    assert event["detail"]["prefix"] == secret[:8] and "sha256" not in event["detail"]
    if stores.kind == "sqlite":
        for path in stores.tmp_path.iterdir():  # the file and its WAL
            assert secret.encode() not in path.read_bytes(), path
    else:
        dump = await store.db.fetch("SELECT t::text AS row FROM kiln_keys t UNION ALL "
                                    "SELECT a::text FROM kiln_audit a")
        assert dump and all(secret not in r["row"] for r in dump)


async def test_keys_are_listed_per_org_patched_and_revoked_once(store):
    _, a = await store.create_key("acme", "a")
    _, b = await store.create_key("globex", "b")
    assert [k["id"] for k in await store.list_keys()] == [a["id"], b["id"]]
    assert [k["id"] for k in await store.list_keys(org="globex")] == [b["id"]]

    patched = await store.update_key(a["id"], {"models": ["m2", "m3"], "limit": 1.5, "disabled": True})
    assert (patched["models"], patched["limit"], patched["disabled"]) == (["m2", "m3"], 1.5, True)
    revoked = await store.revoke_key(a["id"])
    assert revoked["revoked"] and revoked["revoked_at"]
    assert await store.revoke_key(a["id"]) == revoked  # again: nothing changes
    assert (await store.update_key(a["id"], {"name": "renamed"}))["revoked"]  # still revoked

    events = await store.list_events()
    assert [e["kind"] for e in events] == ["key.updated", "key.revoked", "key.updated", "key.created",
                                           "key.created"]
    assert events[2]["detail"] == {"from": {"models": None, "limit": None, "disabled": False},
                                   "to": {"models": ["m2", "m3"], "limit": 1.5, "disabled": True}}
    assert all(e["org"] == "acme" for e in events[:3])


async def test_events_are_newest_first_and_paged_by_id(store):
    for i in range(5):
        await store.create_org(f"org{i}")
    assert [e["id"] for e in await store.list_events(limit=2)] == [5, 4]
    assert [e["id"] for e in await store.list_events(limit=2, before=4)] == [3, 2]
    assert [e["subject"] for e in await store.list_events(org="org1")] == ["org1"]


async def test_the_snapshot_holds_what_authentication_needs_at_one_version(stores, store):
    await store.create_org("acme", max_in_flight=3)
    secret, key = await store.create_key("acme", "live")
    revoked_secret, revoked = await store.create_key("acme", "old")
    await store.revoke_key(revoked["id"])
    await store.add_grant("acme", 4.0, "a")
    await store.add_grant("acme", 0.25, "b")

    other = await stores.open()  # another replica, or a running gateway beside a command
    snapshot = await other.snapshot()
    assert snapshot.version == await other.version() == 6
    assert snapshot.orgs == {"acme": await store.get_org("acme")}
    digest = hashlib.sha256(secret.encode()).hexdigest()
    assert snapshot.keys[digest]["id"] == key["id"] and not snapshot.keys[digest]["revoked"]
    assert snapshot.keys[hashlib.sha256(revoked_secret.encode()).hexdigest()]["revoked"]
    assert snapshot.granted == {"acme": 4.25}


async def test_a_change_on_one_connection_moves_the_version_the_other_reads(stores):
    gateway, command = await stores.open(), await stores.open()
    seen = await gateway.version()
    await command.create_org("acme")
    assert await gateway.version() == seen + 1
    assert "acme" in (await gateway.snapshot()).orgs


async def test_postgresql_notifies_the_version_at_commit(pg_stores):
    stores = pg_stores
    listener = await asyncpg.connect(stores.pg_url)
    heard = asyncio.Queue()
    await listener.add_listener(NOTIFY_CHANNEL, lambda *args: heard.put_nowait(args[3]))
    store = await stores.open()
    await store.create_org("acme")
    await store.add_grant("acme", 1.0, "r")
    await store.add_grant("acme", 1.0, "r")  # nothing new: no notification
    assert [await asyncio.wait_for(heard.get(), 5), await asyncio.wait_for(heard.get(), 5)] == ["1", "2"]
    await store.create_org("globex")
    assert await asyncio.wait_for(heard.get(), 5) == "3"
    await listener.close()


async def test_a_store_on_a_postgresql_pool(pg_stores):
    stores = pg_stores
    async with asyncpg.create_pool(stores.pg_url, min_size=2, max_size=2) as pool:
        store = TenancyStore(PostgresDb(pool, timeout=5.0))
        results = await asyncio.gather(*(store.add_grant("acme", 1.0, "same") for _ in range(4)))
        assert sum(created for _, created in results) == 1
        assert (await store.snapshot()).granted == {"acme": 1.0}
        with pytest.raises(asyncio.TimeoutError):  # a database that does not answer in time
            await PostgresDb(pool, timeout=0.2).fetch("SELECT pg_sleep(2)")
        assert await store.version() == 1  # the pool still serves


# -- key usage by period -------------------------------------------------------------------------------

def test_periods_start_at_midnight_utc_each_day_monday_and_first_of_month():
    now = at("2026-12-02T15:30:00+00:00")  # a Wednesday
    created = "2026-11-20T08:00:00.000+00:00"
    assert period_start("daily", created, now) == "2026-12-02T00:00:00.000+00:00"
    assert period_start("weekly", created, now) == "2026-11-30T00:00:00.000+00:00"
    assert period_start("monthly", created, now) == "2026-12-01T00:00:00.000+00:00"
    assert period_start(None, created, now) == created
    assert period_start("weekly", created, at("2026-11-30T00:00:00+00:00")) == "2026-11-30T00:00:00.000+00:00"
    assert period_start("weekly", created, at("2026-11-29T23:59:59.999+00:00")) == "2026-11-23T00:00:00.000+00:00"
    assert period_start("daily", created, at("2026-12-02T01:00:00+02:00")) == "2026-12-01T00:00:00.000+00:00"
    assert period_end("weekly", now) == "2026-12-07T00:00:00.000+00:00"
    assert period_end("monthly", now) == "2027-01-01T00:00:00.000+00:00"
    assert period_end("daily", now) == "2026-12-03T00:00:00.000+00:00"
    assert period_end(None, now) is None


async def test_a_keys_usage_counts_its_rows_of_the_current_period_only(stores):
    store = await stores.open(clock=lambda: at("2026-11-15T12:00:00+00:00"))
    keys = {}
    for reset in ("daily", "weekly", "monthly", None):
        _, keys[reset] = await store.create_key("acme", f"k-{reset}", limit=10.0, limit_reset=reset)
    rows = [  # (created_at, cost): around Monday 2026-11-30 and Tuesday 2026-12-01
        ("2026-11-29T23:59:59.999+00:00", 1.0),  # the Sunday before, in November
        ("2026-11-30T00:00:00.000+00:00", 2.0),  # Monday 00:00: this week
        ("2026-11-30T23:59:59.999+00:00", 4.0),  # Monday, last millisecond
        ("2026-12-01T00:00:00.000+00:00", 8.0),  # the first of the month, today
        ("2026-12-01T10:00:00.123+00:00", 16.0),
    ]
    for n, (created_at, cost) in enumerate(rows):
        for reset, key in keys.items():
            await store.db.fetch(ADD_USAGE, f"gen-{reset}-{n}", created_at, "acme", key["id"], cost)
    await store.db.fetch(ADD_USAGE, "gen-other", "2026-12-01T11:00:00.000+00:00", "acme", "key_other", 100.0)

    now = at("2026-12-01T12:00:00+00:00")
    usage = await store.usage_by_key(keys.values(), now)
    assert usage == {keys["daily"]["id"]: 24.0, keys["weekly"]["id"]: 30.0, keys["monthly"]["id"]: 24.0,
                     keys[None]["id"]: 31.0}
    since = period_start("weekly", keys["weekly"]["created_at"], now)
    assert await key_usage(store.db, keys["weekly"]["id"], since) == 30.0
    assert await key_usage(store.db, "key_unused", since) == 0.0
    assert await store.usage_by_key([], now) == {}


# -- migrations ----------------------------------------------------------------------------------------

async def test_an_sqlite_file_with_only_usage_events_takes_the_migration_at_open(tmp_path):
    path = ledger_file(tmp_path / "old.db")
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute(ADD_USAGE, ("gen-1", "2026-11-29T20:00:00.123+00:00", "acme", "key-1", 0.5))
    conn.close()

    db = SQLiteDb(path)
    await db.open()
    store = TenancyStore(db)
    assert await store.version() == 0
    await store.create_org("acme")
    assert await db.fetchval("SELECT count(*) FROM usage_events") == 1
    await db.close()

    conn = sqlite3.connect(path, isolation_level=None)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == len(SQLITE_MIGRATIONS)
    assert migrate_sqlite(conn) == len(SQLITE_MIGRATIONS)  # again: nothing to do
    assert conn.execute("SELECT count(*) FROM kiln_runtime_orgs").fetchone()[0] == 1
    assert conn.execute("SELECT name FROM sqlite_master WHERE name = 'usage_events_key_created'").fetchone()
    conn.execute(f"PRAGMA user_version = {len(SQLITE_MIGRATIONS) + 1}")
    with pytest.raises(StorageError, match="newer than this kilnproxy"):
        migrate_sqlite(conn)
    conn.close()


def test_an_sqlite_file_without_usage_events_is_refused_in_one_line(tmp_path):
    conn = sqlite3.connect(tmp_path / "empty.db", isolation_level=None)
    with pytest.raises(StorageError, match="no usage_events table"):
        migrate_sqlite(conn)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == 0
    conn.close()


async def test_a_postgresql_database_of_the_last_release_takes_the_migrations(pg_url):
    conn = await asyncpg.connect(pg_url)
    try:
        previous = 1  # the schema of the release before runtime tenancy
        await conn.execute("CREATE TABLE kiln_schema (version INTEGER NOT NULL)")
        for version in range(previous):
            await conn.execute(pg_schema.MIGRATIONS[version])
            await conn.execute("INSERT INTO kiln_schema (version) VALUES ($1)", version + 1)
        await conn.execute("INSERT INTO usage_events (id, created_at, org, key_id, endpoint, stream, status, cost) "
                           "VALUES ('gen-1', '2026-11-29T20:00:00.123+00:00', 'acme', 'key-1', 'completions', "
                           "1, 200, 0.5)")
        assert await conn.fetchval("SELECT to_regclass('kiln_keys')") is None

        assert await pg_schema.migrate(conn) == previous
        assert await conn.fetchval("SELECT max(version) FROM kiln_schema") == len(pg_schema.MIGRATIONS)
        store = TenancyStore(PostgresDb(conn))
        _, key = await store.create_key("acme", "after-upgrade")
        assert await key_usage(store.db, "key-1", "2026-11-01T00:00:00.000+00:00") == 0.5
        assert await pg_schema.migrate(conn) == len(pg_schema.MIGRATIONS)  # a second replica: nothing to do
    finally:
        await conn.close()


# -- the admin bodies ----------------------------------------------------------------------------------

@pytest.mark.parametrize("check, body, param", [
    (bodies.org_create, [], None),
    (bodies.org_create, {}, "id"),
    (bodies.org_create, {"id": ""}, "id"),
    (bodies.org_create, {"id": "a/b"}, "id"),
    (bodies.org_create, {"id": "acme", "credits": 5}, "credits"),
    (bodies.org_create, {"id": "acme", "max_in_flight": 0}, "max_in_flight"),
    (bodies.org_create, {"id": "acme", "max_in_flight": "4"}, "max_in_flight"),
    (bodies.org_create, {"id": "acme", "max_in_flight": True}, "max_in_flight"),
    (bodies.org_patch, {"disabled": "true"}, "disabled"),
    (bodies.org_patch, {"id": "renamed"}, "id"),
    (bodies.org_patch, {"requests_per_minute": 1.5}, "requests_per_minute"),
    (bodies.grant_create, {"amount": "5.00", "reference": "r"}, "amount"),
    (bodies.grant_create, {"amount": True, "reference": "r"}, "amount"),
    (bodies.grant_create, {"amount": float("nan"), "reference": "r"}, "amount"),
    (bodies.grant_create, {"amount": 5}, "reference"),
    (bodies.grant_create, {"amount": 5, "reference": ""}, "reference"),
    (bodies.grant_create, {"amount": 5, "reference": "  "}, "reference"),
    (bodies.grant_create, {"amount": 5, "reference": 7}, "reference"),
    (bodies.grant_create, "amount=5", None),
    (bodies.key_create, {"org": "acme"}, "name"),
    (bodies.key_create, {"org": "acme", "name": ""}, "name"),
    (bodies.key_create, {"org": "acme", "name": "n", "limit": -1}, "limit"),
    (bodies.key_create, {"org": "acme", "name": "n", "limit": "1"}, "limit"),
    (bodies.key_create, {"org": "acme", "name": "n", "limit_reset": "hourly"}, "limit_reset"),
    (bodies.key_create, {"org": "acme", "name": "n", "expires_at": "next tuesday"}, "expires_at"),
    (bodies.key_create, {"org": "acme", "name": "n", "expires_at": 1767225600}, "expires_at"),
    (bodies.key_create, {"org": "acme", "name": "n", "models": "m1"}, "models"),
    (bodies.key_create, {"org": "acme", "name": "n", "models": []}, "models"),
    (bodies.key_create, {"org": "acme", "name": "n", "models": ["m1", 2]}, "models"),
    (bodies.key_create, {"org": "acme", "name": "n", "disabled": True}, "disabled"),
    (bodies.key_create, {"org": "acme", "name": "n", "key": "sk-mine"}, "key"),
    (bodies.key_patch, {"limit": -0.01}, "limit"),
    (bodies.key_patch, {"org": "globex"}, "org"),
    (bodies.key_patch, {"revoked": True}, "revoked"),
    (bodies.key_patch, {"disabled": 1}, "disabled"),
    (bodies.key_patch, None, None),
])
def test_a_bad_body_is_a_400_naming_the_field(check, body, param):
    with pytest.raises(GatewayError) as refused:
        check(body)
    error = refused.value.payload()["error"]
    assert (refused.value.status, error["code"], error["param"]) == (400, "invalid_request", param)


def test_good_bodies_come_back_normalised():
    assert bodies.org_create({"id": "acme"}) == {
        "id": "acme", "max_in_flight": None, "requests_per_minute": None, "tokens_per_minute": None,
        "priority": None, "weight": None}
    assert bodies.org_patch({"disabled": False, "max_in_flight": None}) == {"disabled": False, "max_in_flight": None}
    assert bodies.grant_create({"amount": -3, "reference": "refund"}) == {"amount": -3.0, "reference": "refund"}
    key = bodies.key_create({"org": "acme", "name": "ci", "limit": 0, "limit_reset": None,
                             "expires_at": "2026-12-31T23:59:59Z", "models": ["a", "b", "a"]})
    assert key == {"org": "acme", "name": "ci", "models": ["a", "b"], "limit": 0.0, "limit_reset": None,
                   "expires_at": "2026-12-31T23:59:59.000+00:00", "requests_per_minute": None,
                   "tokens_per_minute": None, "priority": None, "weight": None, "role": None}
    assert bodies.key_patch({"expires_at": "2027-01-01T02:00:00+02:00"}) == {
        "expires_at": "2027-01-01T00:00:00.000+00:00"}
    assert bodies.key_patch({"expires_at": "2027-01-01"}) == {"expires_at": "2027-01-01T00:00:00.000+00:00"}
    assert bodies.key_patch({}) == {}


def test_a_body_that_is_not_json_is_a_400_without_param():
    with pytest.raises(GatewayError) as refused:
        bodies.parse_body(b"{'amount': 5}")
    assert (refused.value.status, refused.value.param) == (400, None)
    assert bodies.parse_body(b'{"amount": 5}') == {"amount": 5}
