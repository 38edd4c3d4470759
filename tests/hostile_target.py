"""A real ``python -m kilnproxy`` process in front of a real mock upstream process, to attack.

``Target`` checks, after each request, what must hold whatever a client sends
(``check``), and at the end what must hold of the whole run (``check_end``):
no 500, every gateway 4xx a JSON error with ``error.code``, exactly one usage
row per generation id handed out, the process still up with nothing in its
log that looks like a bug, and no org left with a request in flight.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import aiohttp
from processes import GatewayProcess, MockProcess, gateway_config
from prometheus_client.parser import text_string_to_metric_families
from rawhttp import RawResponse

GEN = "x-neocloud-generation-id"
COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")
# What the gateway's log may never say, whatever a client sends.
BUG_SIGNS = ("Traceback", "unexpected error", "Unhandled exception", "Error handling request")


class Target:
    def __init__(self, tmp_path: Path):
        self.tmp_path = tmp_path
        self.mock = MockProcess(tmp_path)
        self.gateway: GatewayProcess | None = None
        self.url = ""
        self.ids: set[str] = set()
        self.requests = 0
        self.unanswered_rows = 0  # rows of requests whose client left before any answer (no id seen)
        self._db: sqlite3.Connection | None = None

    async def start(self) -> "Target":
        await self.mock.start()
        config = gateway_config([self.mock.url], server={"max_request_bytes": 256 * 1024})
        self.gateway = await GatewayProcess(self.tmp_path, config).start()
        self.url = self.gateway.url
        self._db = sqlite3.connect(f"file:{self.tmp_path / 'usage.db'}?mode=ro", uri=True)
        return self

    async def stop(self) -> None:
        if self._db is not None:
            self._db.close()
        if self.gateway is not None:
            await self.gateway.stop()
        await self.mock.stop()

    def rows_of(self, generation_id: str) -> list[tuple]:
        """The rows of that id, once there is one: a lone request's row reaches the table a moment after
        its response ended (it was in the row journal), so one not there yet is waited for, 10 s at most."""
        deadline = time.monotonic() + 10
        while True:
            rows = self._db.execute("SELECT status, error_code FROM usage_events WHERE id = ?",
                                    (generation_id,)).fetchall()
            if rows or time.monotonic() > deadline:
                return rows
            time.sleep(0.001)

    def row_count(self) -> int:
        return self._db.execute("SELECT COUNT(*) FROM usage_events").fetchone()[0]

    def check(self, resp: RawResponse, *, method: str, path: str, known_key: bool) -> None:
        """What must hold of one answer of the gateway's own handlers (not of aiohttp's parser)."""
        self.requests += 1
        generation_id = resp.headers.get(GEN)
        if generation_id is not None:  # first: the end state counts it even if a check below fails
            assert generation_id not in self.ids, f"generation id {generation_id} handed out twice"
            self.ids.add(generation_id)
        assert self.gateway.proc.returncode is None, "the gateway died"
        assert resp.status < 500, (resp.status, resp.headers, resp.body[:500])
        if resp.status >= 400 and method != "HEAD":
            assert resp.headers.get("content-type", "").startswith("application/json"), (resp.status, resp.body[:300])
            error = resp.json()["error"]
            assert error.get("code") is not None, resp.body[:300]
        completions = path.split("?")[0] in COMPLETION_PATHS
        if completions and method == "POST" and known_key:
            assert generation_id, (resp.status, resp.headers)
        if generation_id is not None:
            rows = self.rows_of(generation_id)
            assert len(rows) == 1, (generation_id, rows)
            assert rows[0][0] == resp.status, (rows, resp.status, resp.body[:300])
        if completions and resp.status == 200 and resp.headers.get("content-type", "").startswith("text/event-stream"):
            assert resp.body.endswith(b"data: [DONE]\n\n"), resp.body[-300:]

    async def in_flight(self) -> dict[str, float]:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{self.url}/metrics") as r:
                assert r.status == 200
                text = await r.text()
        return {s.labels["org"]: s.value for family in text_string_to_metric_families(text)
                if family.name == "kilnproxy_in_flight_requests" for s in family.samples}

    async def check_end(self, eventually) -> None:
        assert self.gateway.proc.returncode is None, "the gateway died"
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{self.url}/healthz") as r:
                assert r.status == 200
        await eventually(lambda: self._all_zero())
        assert self.row_count() == len(self.ids) + self.unanswered_rows, (self.row_count(), len(self.ids))
        bad = [line for line in self.gateway.lines["stderr"] if any(sign in line for sign in BUG_SIGNS)]
        assert not bad, "\n".join(self.gateway.lines["stderr"][-80:])

    async def _all_zero(self) -> bool:
        counts = await self.in_flight()
        return bool(counts) and not any(counts.values())
