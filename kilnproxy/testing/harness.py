"""``Harness``: a real gateway in front of the mock upstream, and the helpers tests share
(the test config, usage rows, bodies, free ports). Public through ``kilnproxy.testing``."""

from __future__ import annotations

import copy
import socket
import sqlite3
import time
from pathlib import Path
from typing import Any, Callable

import aiohttp

from ..config import parse_config
from ..mock_servers.format import Fixture
from ..proxy.gateway import GATEWAY, Gateway
from ..web.app import create_app
from ..web.server import Running, start_app, start_mock
from .recordings import Replay

KEY = "sk-test-acme"
OTHER_KEY = "sk-test-globex"
MODEL = "test-model"
UPSTREAM_MODEL = "org/Test-Model-7B"
def base_config(mock_url: str, db: Path) -> dict[str, Any]:
    return {
        "server": {"host": "127.0.0.1", "port": 0, "keepalive_seconds": 15},
        "storage": {"path": str(db)},
        "models": [{
            "id": MODEL,
            "upstreams": [mock_url],
            "upstream_model": UPSTREAM_MODEL,
            "context_window": 4096,
            "reject_chat_params": ["ignore_eos"],
            "pricing": {"prompt": 0.10, "completion": 0.30, "cached_prompt": 0.05},
        }],
        "orgs": [{"id": "acme", "credits": 100.0}, {"id": "globex", "credits": 100.0}],
        "keys": [{"key": KEY, "org": "acme", "id": "acme-key"},
                 {"key": OTHER_KEY, "org": "globex", "id": "globex-key"}],
        "plugins": {"modules": [], "entry_points": False},
        "health": {"interval": 0},  # no active checks: a test decides when an upstream is down
    }


def usage_rows(db: Path, **where: Any) -> list[dict[str, Any]]:
    """The usage rows in the SQLite file ``db`` whose columns equal ``where``, oldest first."""
    conn = sqlite3.connect(db)
    conn.row_factory = sqlite3.Row
    try:
        sql = "SELECT * FROM usage_events"
        if where:
            sql += " WHERE " + " AND ".join(f"{k} = ?" for k in where)
        return [dict(r) for r in conn.execute(sql + " ORDER BY created_at, rowid", tuple(where.values()))]
    finally:
        conn.close()


def usage_row(db: Path, generation_id: str, timeout: float = 10.0) -> dict[str, Any]:
    """The usage row of ``generation_id`` in the SQLite file ``db``, waited for up to ``timeout`` seconds:
    read from another process, the row of a request the gateway served alone reaches the table a moment
    after its response ended (it was in the row journal first). AssertionError if it does not come."""
    deadline = time.monotonic() + timeout
    while not (found := usage_rows(db, id=generation_id)):
        assert time.monotonic() < deadline, f"no usage row for {generation_id} in {db} after {timeout} s"
        time.sleep(0.005)
    return found[0]


async def pg_usage_rows(url: str, **where: Any) -> list[dict[str, Any]]:
    """``usage_rows`` for the PostgreSQL database at ``url``: the same columns (not ``rowid`` nor
    ``replica``), oldest first."""
    from ..store.reads import pg_fetch
    from ..usage import COLUMNS
    sql = f"SELECT {', '.join(COLUMNS)} FROM usage_events"
    if where:
        sql += " WHERE " + " AND ".join(f"{k} = ?" for k in where)
    return await pg_fetch(url, sql + " ORDER BY created_at, rowid", tuple(where.values()))


def completion_body(stream: bool = False, **extra: Any) -> dict[str, Any]:
    """A /v1/completions body for the test model; streamed ones ask for the usage chunk."""
    out = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4}
    if stream:
        out.update(stream=True, stream_options={"include_usage": True})
    out.update(extra)
    return out


def free_port() -> int:
    """A loopback port nobody listens on (for a dead upstream or a process to start)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Harness:
    """An async context manager: mock upstream + gateway, stopped on exit."""

    model = MODEL
    key = KEY

    def __init__(self, tmp_path: Path, *, plugins: list[Any] | None = None,
                 settings: dict[str, dict] | None = None, overrides: dict[str, Any] | None = None,
                 mock_options: dict[str, Any] | None = None, entry_points: bool = False,
                 base_dir: Path | None = None, configure: Callable[[dict], None] | None = None,
                 replay: Any = None):
        self.tmp_path = Path(tmp_path)
        self.db = self.tmp_path / "usage.db"
        self.plugins = plugins or []
        self.settings = settings or {}
        self.overrides = overrides or {}
        self.mock_options = mock_options or {}
        self.entry_points = entry_points
        self.base_dir = base_dir or Path.cwd()
        self.configure = configure
        self.replay = Replay.of(replay) if replay is not None else None
        self.fixtures: list[Fixture] = self.replay.fixtures if self.replay is not None else []
        self.mock: Running | None = None
        self.gateway: Running | None = None
        self.session: aiohttp.ClientSession | None = None
        self.config: dict[str, Any] = {}
        self._clients: list = []

    async def __aenter__(self) -> "Harness":
        self.mock = await (self.replay.start() if self.replay is not None else start_mock(**self.mock_options))
        self.config = base_config(f"{self.mock.url}/v1", self.db)
        recorded = [f.model for f in self.fixtures if isinstance(f.model, str)]
        if recorded:
            self.config["models"][0]["upstream_model"] = recorded[0]
        modules = [str(p) for p in self.plugins if isinstance(p, (str, Path))]
        objects = [p for p in self.plugins if not isinstance(p, (str, Path))]
        self.config["plugins"] = {"modules": modules, "entry_points": self.entry_points,
                                  "settings": self.settings}
        for section, value in self.overrides.items():
            if isinstance(value, dict) and isinstance(self.config.get(section), dict):
                self.config[section] = {**self.config[section], **value}
            else:
                self.config[section] = copy.deepcopy(value)
        if self.configure is not None:
            self.configure(self.config)
        try:
            config = parse_config(self.config, source="<test>", base_dir=self.base_dir)
            self.gateway = await start_app(create_app(config, objects), config.server.host, config.server.port)
        except BaseException:
            await self.mock.stop()
            raise
        self.session = aiohttp.ClientSession()
        return self

    async def __aexit__(self, *exc) -> None:
        for client in self._clients:
            await client.close()
        await self.session.close()
        await self.gateway.stop()
        await self.mock.stop()

    @property
    def url(self) -> str:
        return self.gateway.url

    @property
    def mock_url(self) -> str:
        return self.mock.url

    @property
    def app(self):
        return self.gateway.app

    @property
    def gw(self) -> Gateway:
        """The running ``Gateway``: ``h.gw.config``, ``h.gw.hooks``, ``h.gw.plugin_settings(name)``."""
        return self.gateway.app[GATEWAY]

    async def usage_recorded(self) -> None:
        """Wait until every usage row committed so far has been through ``record_usage``."""
        await self.gw.usage_recorded()

    def headers(self, key: str | None = None) -> dict[str, str]:
        return {"Authorization": f"Bearer {key or self.key}"}

    def openai(self, key: str | None = None, **kwargs):
        """An ``openai.AsyncOpenAI`` client for the gateway (closed on exit)."""
        import openai
        client = openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=key or self.key, max_retries=0, **kwargs)
        self._clients.append(client)
        return client

    def post(self, path: str, json: Any = None, *, key: str | None = None, **kwargs):
        """``aiohttp`` POST to the gateway with the test key (use as ``async with``)."""
        headers = {**self.headers(key), **kwargs.pop("headers", {})}
        return self.session.post(f"{self.url}{path}", json=json, headers=headers, **kwargs)

    def client_body(self, fixture: Fixture | int = 0) -> Any:
        """A fixture's request body as a client of this gateway sends it (``model``: the catalog id)."""
        fixture = self.fixtures[fixture] if isinstance(fixture, int) else fixture
        return {**fixture.body, "model": self.model} if isinstance(fixture.body, dict) else fixture.body

    async def rows(self, **where: Any) -> list[dict[str, Any]]:
        """The usage rows whose columns equal ``where``, oldest first, every response ended so far included."""
        await self.gw.rows_committed()
        url = self.gw.config.storage.url
        return await pg_usage_rows(url, **where) if url else usage_rows(self.db, **where)

    async def row(self, generation_id: str) -> dict[str, Any]:
        rows = await self.rows(id=generation_id)
        assert len(rows) == 1, f"expected one usage row for {generation_id}, found {len(rows)}"
        return rows[0]

    async def mock_requests(self) -> list[dict[str, Any]]:
        async with self.session.get(f"{self.mock_url}/mock/requests") as resp:
            return await resp.json()

    async def mock_wait(self, **counter: int) -> dict[str, int]:
        async with self.session.get(f"{self.mock_url}/mock/wait", params=counter) as resp:
            return await resp.json()
