"""The throw-away PostgreSQL server of the tests (kilnproxy.testing.postgres), seen through asyncpg."""

import socket

import asyncpg
import pytest

from kilnproxy.testing.postgres import PostgresServer


async def test_the_right_password_connects_as_kiln_to_its_own_database(postgres, pg_url):
    conn = await asyncpg.connect(pg_url)
    try:
        assert await conn.fetchval("SELECT current_user") == "kiln"
        await conn.execute("CREATE TABLE t (x int)")  # kiln owns the database
        await conn.execute("INSERT INTO t VALUES (1)")
    finally:
        await conn.close()
    database = pg_url.rsplit("/", 1)[1]
    assert postgres.psql("SELECT datname, pg_get_userbyid(datdba) FROM pg_database "
                         f"WHERE datname = '{database}'") == f"{database}|kiln\n"


async def test_a_wrong_password_is_refused(postgres, pg_url):
    database = pg_url.rsplit("/", 1)[1]
    with pytest.raises(asyncpg.InvalidPasswordError):
        await asyncpg.connect(postgres.url(database, password="wrong"))
    with pytest.raises(asyncpg.InvalidPasswordError):
        await asyncpg.connect(postgres.url(database, user="postgres", password="anything"))


async def test_terminate_connections_drops_only_the_named_application(postgres, pg_url):
    database = pg_url.rsplit("/", 1)[1]
    doomed = await asyncpg.connect(pg_url, server_settings={"application_name": "replica-a"})
    other = await asyncpg.connect(pg_url, server_settings={"application_name": "replica-b"})
    try:
        assert postgres.terminate_connections(database, application_name="replica-a") == 1
        with pytest.raises((asyncpg.ConnectionDoesNotExistError, asyncpg.AdminShutdownError)):
            await doomed.fetchval("SELECT 1")
        assert await other.fetchval("SELECT 1") == 1
        assert postgres.terminate_connections(database) == 1
        with pytest.raises((asyncpg.ConnectionDoesNotExistError, asyncpg.AdminShutdownError)):
            await other.fetchval("SELECT 1")
    finally:
        await doomed.close()
        await other.close()


async def test_data_survives_stop_and_start_and_the_folder_goes_with_the_server():
    with PostgresServer() as pg:
        folder, port = pg.folder, pg.port
        url = pg.create_database("kept")
        conn = await asyncpg.connect(url)
        await conn.execute("CREATE TABLE t (x int); INSERT INTO t VALUES (42)")
        await conn.close()

        pg.stop("immediate")  # a crash as far as the database is concerned
        assert not pg.running
        with pytest.raises(OSError):
            await asyncpg.connect(url)

        pg.start()
        assert pg.port == port
        conn = await asyncpg.connect(url)
        assert await conn.fetchval("SELECT x FROM t") == 42
        await conn.close()
    assert not folder.exists()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port)).close()
