"""A rolling restart behind nginx fails nothing: two replicas on one PostgreSQL, one of them
stopped with SIGTERM under steady streamed and non-streamed load, then started again."""

import asyncio
import signal

import aiohttp
import orjson
from nginx import Nginx
from processes import GatewayProcess
from replicas import Ledger, replica_config

from kilnproxy.testing import KEY, MODEL, free_port

AUTH = {"Authorization": f"Bearer {KEY}"}
GEN = "X-Neocloud-Generation-Id"
MAX_REQUESTS = 20_000  # the load stops by itself past this, whatever happens


class Load:
    """Clients sending requests through nginx until told to stop; every answer is kept."""

    def __init__(self, url: str):
        self.url = url
        self.ids: list[str] = []
        self.failures: list[str] = []
        self.streams = 0
        self.stop = asyncio.Event()

    async def client(self, session: aiohttp.ClientSession, stream: bool) -> None:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 4, "stream": stream, "mock": {"delay": 0.005}}
        while not self.stop.is_set() and len(self.ids) + len(self.failures) < MAX_REQUESTS:
            try:
                async with session.post(f"{self.url}/v1/completions", headers=AUTH, json=body) as r:
                    raw = await r.read()
                    if r.status != 200:
                        self.failures.append(f"{r.status} {raw[:200]!r}")
                        continue
                    if stream and not raw.endswith(b"data: [DONE]\n\n"):
                        self.failures.append(f"stream without [DONE]: {raw[-200:]!r}")
                        continue
                    if not stream:
                        assert orjson.loads(raw)["object"] == "text_completion"
                    self.ids.append(r.headers[GEN])
                    self.streams += stream
            except aiohttp.ClientError as exc:
                self.failures.append(repr(exc))


async def served(process: GatewayProcess, count: int) -> None:
    """Until the replica's access log has ``count`` lines of completions."""
    await process.wait_for("stdout", '"endpoint":"completions"', count=count)


async def test_sigterm_and_restart_of_one_replica_under_load_fails_nothing(tmp_path, mock_url, pg_url):
    ports = {"a": free_port(), "b": free_port()}

    def config(name: str) -> dict:
        return replica_config(mock_url, pg_url, server={"port": ports[name], "drain_seconds": 2})

    for name in ports:
        (tmp_path / name).mkdir()
    a, b = await asyncio.gather(*(GatewayProcess(tmp_path / n, config(n)).start() for n in ports))
    nginx = await Nginx(tmp_path / "nginx", list(ports.values())).start()
    a2 = None
    load = Load(nginx.url)
    clients: list[asyncio.Task] = []
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s, \
                aiohttp.ClientSession() as direct:
            clients += [asyncio.create_task(load.client(s, stream=i % 2 == 0)) for i in range(12)]
            await asyncio.gather(served(a, 50), served(b, 50))

            a.send(signal.SIGTERM)
            await a.wait_for("stderr", "draining: /healthz?ready answers 503")
            async with direct.get(f"{a.url}/healthz?ready") as r:
                assert (r.status, await r.json()) == (503, {"status": "not_ready", "store": "up", "draining": True})
                assert r.headers["Connection"] == "close"
            async with direct.get(f"{a.url}/healthz") as r:
                assert (r.status, await r.json()) == (200, {"status": "ok", "store": "up", "draining": True})
            async with direct.get(f"{b.url}/healthz?ready") as r:
                assert (r.status, await r.json()) == (200, {"status": "ok", "store": "up"})
            assert await a.wait() == 0

            a2 = await GatewayProcess(tmp_path / "a", config("a")).start()  # same folder, config and port
            await served(a2, 50)  # nginx sends it requests again
            load.stop.set()
            await asyncio.gather(*clients)

        assert load.failures == [], nginx.errors() + "\n".join(a.lines["stderr"][-30:])
        assert load.streams > 0 and len(load.ids) - load.streams > 0
        async with Ledger(pg_url) as ledger:
            rows = await ledger.rows()
        assert sorted(r["id"] for r in rows) == sorted(load.ids)  # exactly one row per request
        assert all(r["status"] == 200 and r["error_code"] is None for r in rows)
        # what nginx saw of the restart: at most connections refused while nothing listened (it sent
        # those requests to the other replica; a new connection tried as the listener closes is held
        # off, and its retry may reach the replica started again), never a connection closed under a request
        problems = [line for line in nginx.errors().splitlines() if "upstream" in line]
        assert all("connect() failed (111: Connection refused)" in line
                                or "upstream server temporarily disabled while connecting" in line
                                for line in problems), problems
    finally:
        load.stop.set()
        for task in clients:
            task.cancel()
        await nginx.stop()
        await asyncio.gather(*(p.stop() for p in (a, b, a2) if p is not None))
