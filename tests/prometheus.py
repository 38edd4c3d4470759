"""Debian's Prometheus, run as a process of the test's own (never the Debian service), for tests.

``Prometheus(folder, targets, rule_files)`` writes a config that scrapes the
targets' ``/metrics`` every second and evaluates the rule files every second;
``start()`` runs ``/usr/bin/prometheus`` on a free loopback port with its
storage in ``folder`` and returns once it is ready. ``query`` and ``until``
read through its HTTP query API. ``make prometheus`` installs it (and
``promtool``).
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import aiohttp

from kilnproxy.testing import free_port

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
DEADLINE = 30.0  # seconds any awaited state may take: several scrapes and evaluations


def config(targets: list[str], rule_files: list[Path]) -> str:
    # JSON is YAML: no YAML writer needed
    return json.dumps({
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(Path(f).resolve()) for f in rule_files],
        "scrape_configs": [{"job_name": "kilnproxy", "metrics_path": "/metrics",
                            "static_configs": [{"targets": targets}]}],
    }, indent=2)


class Prometheus:
    def __init__(self, folder: Path, targets: list[str], rule_files: list[Path] = ()):
        self.folder = Path(folder)
        self.folder.mkdir(exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.conf = self.folder / "prometheus.yml"
        self.conf.write_text(config(targets, list(rule_files)))
        self.log = self.folder / "prometheus.log"
        self.proc: asyncio.subprocess.Process | None = None
        self.session: aiohttp.ClientSession | None = None

    async def start(self) -> "Prometheus":
        with self.log.open("wb") as log:
            self.proc = await asyncio.create_subprocess_exec(
                PROMETHEUS, f"--config.file={self.conf}", f"--storage.tsdb.path={self.folder / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1h",
                "--log.level=warn", stdout=log, stderr=log)
        self.session = aiohttp.ClientSession()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + DEADLINE
        while loop.time() < deadline:
            assert self.proc.returncode is None, f"prometheus exited: {self.errors()}"
            try:
                async with self.session.get(f"{self.url}/-/ready") as r:
                    if r.status == 200:
                        return self
            except aiohttp.ClientConnectionError:
                pass
            await asyncio.sleep(0.05)
        raise AssertionError(f"prometheus was not ready in {DEADLINE} s: {self.errors()}")

    def errors(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""

    async def api(self, path: str, **params) -> dict | list:
        async with self.session.get(f"{self.url}/api/v1/{path}", params=params) as r:
            body = await r.json()
        assert body["status"] == "success", body
        return body["data"]

    async def query(self, expr: str) -> dict[tuple, float]:
        """An instant vector: each series' labels (``__name__``, ``job`` and ``instance`` left out,
        sorted pairs) -> its value."""
        data = await self.api("query", query=expr)
        assert data["resultType"] == "vector", data
        return {tuple(sorted((k, v) for k, v in s["metric"].items() if k not in ("__name__", "job", "instance"))):
                float(s["value"][1]) for s in data["result"]}

    async def until(self, read, expected, timeout: float = DEADLINE):
        """Await ``read()`` (a coroutine function) returning ``expected``; fail with its last value."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            got = await read()
            if got == expected:
                return got
            assert loop.time() < deadline, f"after {timeout} s: {got!r}, expected {expected!r}"
            await asyncio.sleep(0.2)

    async def stop(self) -> None:
        if self.session is not None:
            await self.session.close()
        if self.proc is not None and self.proc.returncode is None:
            self.proc.terminate()
            try:
                await asyncio.wait_for(self.proc.wait(), 10)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
