"""``kill -9`` of the gateway under load loses no row of a response that had ended (usage accounting (docs/reference.md)).

The gateway runs as users run it, ``python -m kilnproxy --config FILE``, in front of the mock
upstream. Clients keep streamed and non-streamed requests going; once enough have finished,
the gateway gets SIGKILL. Restarted on the same database, every generation id whose response a
client saw end (a non-streamed body read whole, a stream up to ``data: [DONE]``) is in the table.
"""

import asyncio
import os
import signal
import sqlite3
import sys
from pathlib import Path

import aiohttp
import pytest

from kilnproxy.web.server import start_mock

KEY = "sk-kill-acme"
OTHER_KEY = "sk-kill-globex"
MODEL = "kill-model"
GEN = "X-Neocloud-Generation-Id"


def write_config(path: Path, mock_url: str, credits: float = 100.0) -> Path:
    path.write_text(f'''
[server]
host = "127.0.0.1"
port = 0

[storage]
path = "usage.db"

[limits]
max_in_flight_per_org = 64

[[models]]
id = "{MODEL}"
upstreams = ["{mock_url}/v1"]
upstream_model = "org/Kill-Model"
[models.pricing]
prompt = 0.10
completion = 0.30

[[orgs]]
id = "acme"
credits = {credits}

[[orgs]]
id = "globex"
credits = {credits}

[[keys]]
key = "{KEY}"
org = "acme"

[[keys]]
key = "{OTHER_KEY}"
org = "globex"

[plugins]
entry_points = false
''')
    return path


class GatewayProcess:
    """``python -m kilnproxy --config FILE`` on a free port; ``url`` once it serves."""

    def __init__(self, config: Path, log: Path):
        self.config = config
        self.log = log
        self.proc: asyncio.subprocess.Process | None = None
        self.url = ""

    async def start(self) -> "GatewayProcess":
        with open(self.log, "ab") as log:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "kilnproxy", "--config", str(self.config),
                stdout=asyncio.subprocess.PIPE, stderr=log, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        line = await asyncio.wait_for(self.proc.stdout.readline(), 30)
        assert b"kilnproxy serving" in line, (line, self.log.read_text())
        self.url = line.split(b" on ", 1)[1].split()[0].decode()
        # the access log follows on stdout: keep reading it, or the pipe fills and wait() never returns
        self._reader = asyncio.create_task(self._discard_stdout())
        return self

    async def _discard_stdout(self) -> None:
        while await self.proc.stdout.read(65536):
            pass

    async def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        assert await self.proc.wait() == -signal.SIGKILL
        await self._reader

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.terminate()
            assert await asyncio.wait_for(self.proc.wait(), 30) == 0
            await self._reader


def ids_in_db(db: Path) -> set[str]:
    conn = sqlite3.connect(db)
    try:
        return {r[0] for r in conn.execute("SELECT id FROM usage_events")}
    finally:
        conn.close()


async def load_until_killed(url: str, session: aiohttp.ClientSession, gateway: GatewayProcess,
                            kill_after: int, workers: int = 48, stop=None) -> tuple[set[str], set[str], int]:
    """Requests from ``workers`` clients; SIGKILL (or ``stop()``) once ``kill_after`` have ended.
    Returns the ids of the responses that ended, of those whose headers came, and how many
    requests were cut short."""
    ended: set[str] = set()
    answered: set[str] = set()
    cut = 0
    killed = asyncio.Event()
    stop = stop or gateway.kill9

    async def one(i: int) -> None:
        nonlocal cut
        kind = i % 4
        request = {"model": MODEL, "prompt": f"request {i}", "max_tokens": 2 + i % 9,
                   "mock": {"delay": 0.002}}
        if kind in (1, 2):
            request.update(stream=True, stream_options={"include_usage": kind == 1})
        if kind == 3 and i % 8 == 3:
            request["model"] = "not-a-model"  # an error answer: its row must survive as well
        key = KEY if i % 2 else OTHER_KEY
        try:
            async with session.post(f"{url}/v1/completions", json=request,
                                    headers={"Authorization": f"Bearer {key}"}) as resp:
                gen_id = resp.headers[GEN]
                answered.add(gen_id)
                raw = await resp.read()
                if request.get("stream") and not raw.endswith(b"data: [DONE]\n\n"):
                    cut += 1
                    return
        except (aiohttp.ClientError, asyncio.TimeoutError):
            cut += 1
            return
        ended.add(gen_id)
        if len(ended) >= kill_after and not killed.is_set():
            killed.set()
            await stop()

    async def worker(w: int) -> None:
        i = w
        while not killed.is_set():
            await one(i)
            i += workers

    await asyncio.gather(*(worker(w) for w in range(workers)))
    return ended, answered, cut


@pytest.mark.parametrize("round_", [1, 2])
async def test_kill_9_under_load_loses_no_ended_response(tmp_path, round_):
    mock = await start_mock()
    config = write_config(tmp_path / "gateway.toml", mock.url)
    log = tmp_path / "gateway.log"
    db = tmp_path / "usage.db"
    gateway = await GatewayProcess(config, log).start()
    restarted = None
    try:
        async with aiohttp.ClientSession() as session:
            ended, _, cut = await load_until_killed(gateway.url, session, gateway, kill_after=300 * round_)
            assert len(ended) >= 300 * round_
            assert cut > 0  # the kill did land mid-load
            assert (tmp_path / "usage.db-wal").exists()  # killed: no checkpoint on the way out
            restarted = await GatewayProcess(config, log).start()
            missing = ended - ids_in_db(db)
            assert not missing, f"{len(missing)} of {len(ended)} ended responses have no row"
            sample = sorted(ended)[:5]
            for gen_id in sample:
                for key in (KEY, OTHER_KEY):
                    async with session.get(f"{restarted.url}/v1/generations/{gen_id}",
                                           headers={"Authorization": f"Bearer {key}"}) as resp:
                        if resp.status == 200:
                            assert (await resp.json())["id"] == gen_id
                            break
                else:
                    raise AssertionError(f"{gen_id} not served after the restart")
            async with session.post(f"{restarted.url}/v1/completions", json={"model": MODEL, "prompt": "hi"},
                                    headers={"Authorization": f"Bearer {KEY}"}) as resp:
                assert resp.status == 200
                after = resp.headers[GEN]
            async with session.get(f"{restarted.url}/v1/generations/{after}",
                                   headers={"Authorization": f"Bearer {KEY}"}) as resp:
                assert resp.status == 200  # answered once its row is in the table (a lone row: journaled first)
            conn = sqlite3.connect(db)
            try:
                spent = dict(conn.execute("SELECT org, SUM(cost) FROM usage_events GROUP BY org").fetchall())
            finally:
                conn.close()
            async with session.get(f"{restarted.url}/v1/credits",
                                   headers={"Authorization": f"Bearer {KEY}"}) as resp:
                assert (await resp.json())["spent"] == pytest.approx(spent["acme"], rel=1e-12)
            assert after in ids_in_db(db)
    finally:
        if gateway.proc.returncode is None:
            await gateway.kill9()
        if restarted is not None:
            await restarted.stop()
        await mock.stop()
    assert "Traceback" not in log.read_text()


async def test_sigterm_under_load_commits_every_row_and_exits_0(tmp_path):
    """A clean stop (SIGTERM) lets the requests in flight finish: every request that got an
    answer, ended or not, has its row, and the gateway exits 0."""
    mock = await start_mock()
    config = write_config(tmp_path / "gateway.toml", mock.url)
    log = tmp_path / "gateway.log"
    gateway = await GatewayProcess(config, log).start()
    try:
        async with aiohttp.ClientSession() as session:
            async def term() -> None:
                gateway.proc.terminate()
            ended, answered, _ = await load_until_killed(gateway.url, session, gateway, kill_after=200, stop=term)
            assert await asyncio.wait_for(gateway.proc.wait(), 60) == 0
        assert ended <= answered
        missing = answered - ids_in_db(tmp_path / "usage.db")
        assert not missing, f"{len(missing)} of {len(answered)} answered requests have no row"
    finally:
        if gateway.proc.returncode is None:
            await gateway.kill9()
        await mock.stop()
    assert "Traceback" not in log.read_text()
