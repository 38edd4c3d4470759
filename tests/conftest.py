"""Fixtures for every test below (tests/README.md: one folder a part of the package; ``make e2e`` runs e2e/).

This folder is on ``sys.path`` (pytest's ``prepend`` import mode: no ``__init__.py`` here): the
helper modules here (``processes``, ``rawhttp``, ``raw_upstreams``, ...) are imported by name.

The suite runs in parallel (pytest-xdist, setup.cfg's addopts): each worker is a process with its own
session fixtures (its own ``postgres``), and a test owns nothing but its ``tmp_path``, its databases and
the ports it was given (``closed_ports.refused_port`` for one that must stay dead).
"""

import itertools
import re

import pytest

from kilnproxy.testing import Harness
from kilnproxy.testing.postgres import PostgresServer

# tests/e2e needs a real model server: `make e2e` runs it (`pytest tests/e2e`), `make test` does not.
collect_ignore = ["e2e"]


@pytest.fixture
async def gw(tmp_path):
    """A gateway in front of the mock upstream, with the test config of kilnproxy.testing."""
    async with Harness(tmp_path) as h:
        yield h


@pytest.fixture
def harness(tmp_path):
    """Build a Harness with options: ``async with harness(overrides=...) as h``."""
    return lambda **kwargs: Harness(tmp_path, **kwargs)


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request, tmp_path):
    """Config overrides that put a Harness on each store in turn: ``{}`` (SQLite), then a fresh
    PostgreSQL database (``pg_url``). Merge them with a test's own: ``harness(overrides={**store, ...})``."""
    if request.param == "sqlite":
        return {}
    return {"storage": {"url": request.getfixturevalue("pg_url"), "spool_path": str(tmp_path / "spool.db")}}


@pytest.fixture
async def any_gw(harness, store):
    """``gw`` on each store in turn (``store``)."""
    async with harness(overrides=store) as h:
        yield h


@pytest.fixture
async def mock_url():
    """A mock upstream in this process (vLLM-like): its OpenAI base URL, ending in ``/v1``."""
    from kilnproxy.web.server import start_mock

    running = await start_mock()
    yield f"{running.url}/v1"
    await running.runner.cleanup()


@pytest.fixture
def eventually():
    """``await eventually(predicate)``: wait, a few ms at a time and 20 s at most, until it is true.

    For state the gateway reaches after the client has already seen the end (a handler
    cancelled by a hang-up finishes on its own); fails with the predicate's last value.
    """
    import asyncio
    import inspect

    async def wait(predicate, timeout: float = 20.0):
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            value = predicate()
            if inspect.isawaitable(value):
                value = await value
            if value or loop.time() > deadline:
                assert value, f"still false after {timeout} s: {predicate}"
                return value
            await asyncio.sleep(0.005)

    return wait


@pytest.fixture
def committed(eventually):
    """``await committed(h, n, **where)``: the usage rows matching ``where``, once there are ``n``.

    With PostgreSQL a request's slot and hold are freed in the commit of its row, which comes
    just after its client has gone: a test that reuses them waits for the row, not for time."""

    async def wait(h, n: int, **where):
        async def rows():
            found = await h.rows(**where)
            return found if len(found) >= n else None
        return await eventually(rows)

    return wait


@pytest.fixture(scope="session")
def postgres():
    """One throw-away PostgreSQL server for the whole run of a worker (``kilnproxy.testing.postgres``;
    pytest-xdist: one a worker, started when a test first asks for ``pg_url``).

    Shared: a test that stops it must start it again (``pg_url``'s teardown does, if not);
    a test that wants to break the server in other ways starts its own ``PostgresServer()``.
    """
    with PostgresServer() as server:
        yield server


_database_numbers = itertools.count()


@pytest.fixture
def pg_url(postgres, request):
    """The URL of a new, empty database owned by ``kiln`` for this test, dropped after it."""
    test_name = re.sub(r"[^a-z0-9_]", "_", request.node.name.lower())
    name = f"t{next(_database_numbers)}_{test_name}"[:63]
    url = postgres.create_database(name)
    yield url
    if not postgres.running:
        postgres.start()
    postgres.drop_database(name)
