"""Real ``python -m kilnproxy`` processes for tests: the gateway and stand-alone mocks.

``GatewayProcess`` writes a TOML config, starts the gateway, waits for its
start-up banner (the bound URL is read from it), and keeps what the process
writes: ``stdout`` lines (the access log) and ``stderr`` lines (its log).
``wait_for(stream, text)`` returns once a line containing ``text`` appeared,
so tests wait for events, never for time.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sqlite3
import sys
from pathlib import Path
from typing import Any

from kilnproxy.testing import KEY, MODEL, OTHER_KEY, UPSTREAM_MODEL

STARTUP_SECONDS = 30


def toml(doc: dict[str, Any]) -> str:
    """Enough TOML for test configs: tables, arrays of tables, scalars and lists."""
    lines: list[str] = []

    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(value(x) for x in v) + "]"
        if isinstance(v, dict):  # an inline table, e.g. an upstream {url = "...", max_in_flight = 2}
            return "{" + ", ".join(f"{k} = {value(x)}" for k, x in v.items()) + "}"
        raise TypeError(v)

    def table(name: str, t: dict, header: str) -> None:
        lines.append(header)
        subtables = []
        for k, v in t.items():
            if isinstance(v, dict):
                subtables.append((k, v))
            else:
                lines.append(f"{k} = {value(v)}")
        for k, v in subtables:
            table(f"{name}.{k}", v, f"[{name}.{k}]")

    for k, v in doc.items():
        if isinstance(v, dict):
            table(k, v, f"[{k}]")
        elif isinstance(v, list) and v and isinstance(v[0], dict):
            for item in v:
                table(k, item, f"[[{k}]]")
        else:
            lines.insert(0, f"{k} = {value(v)}")
    return "\n".join(lines) + "\n"


def gateway_config(upstreams: list[str], **sections: Any) -> dict[str, Any]:
    """The test config of ``kilnproxy.testing``, for a process: port 0, sections merged one level deep."""
    config: dict[str, Any] = {
        "server": {"host": "127.0.0.1", "port": 0, "drain_seconds": 0},  # tests of the drain set their own
        "storage": {"path": "usage.db"},
        "health": {"interval": 0},
        "models": [{"id": MODEL, "upstreams": upstreams, "upstream_model": UPSTREAM_MODEL,
                    "pricing": {"prompt": 0.10, "completion": 0.30}}],
        "orgs": [{"id": "acme", "credits": 100.0, "max_in_flight": 200}, {"id": "globex", "credits": 100.0}],
        "keys": [{"key": KEY, "org": "acme", "id": "acme-key"}, {"key": OTHER_KEY, "org": "globex",
                                                                   "id": "globex-key"}],
        "plugins": {"entry_points": False},
    }
    for name, value in sections.items():
        if isinstance(value, dict) and isinstance(config.get(name), dict):
            config[name] = {**config[name], **value}
        else:
            config[name] = value
    return config


class Process:
    """A child process whose output lines are kept and can be waited for."""

    def __init__(self, args: list[str], cwd: Path):
        self.args = args
        self.cwd = cwd
        self.proc: asyncio.subprocess.Process | None = None
        self.lines: dict[str, list[str]] = {"stdout": [], "stderr": []}
        self._changed = asyncio.Condition()
        self._readers: list[asyncio.Task] = []

    async def start(self) -> "Process":
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kilnproxy", *self.args, cwd=self.cwd,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self._readers = [asyncio.create_task(self._read(name, getattr(self.proc, name)))
                         for name in ("stdout", "stderr")]
        return self

    async def _read(self, name: str, pipe: asyncio.StreamReader) -> None:
        while line := await pipe.readline():
            async with self._changed:
                self.lines[name].append(line.decode().rstrip("\n"))
                self._changed.notify_all()
        async with self._changed:
            self._changed.notify_all()

    async def wait_for(self, stream: str, text: str, count: int = 1, timeout: float = STARTUP_SECONDS) -> list[str]:
        """The lines of ``stream`` containing ``text``, once there are ``count`` of them."""
        def found() -> list[str]:
            return [line for line in self.lines[stream] if text in line]

        async with self._changed:
            await asyncio.wait_for(self._changed.wait_for(
                lambda: len(found()) >= count or self.proc.returncode is not None or all(
                    r.done() for r in self._readers)), timeout)
        hits = found()
        assert len(hits) >= count, f"{text!r} not in {stream}: {self.lines}"
        return hits

    def send(self, sig: int) -> None:
        self.proc.send_signal(sig)

    async def wait(self, timeout: float = 30) -> int:
        code = await asyncio.wait_for(self.proc.wait(), timeout)
        await asyncio.gather(*self._readers)
        return code

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()
        await asyncio.gather(*self._readers, return_exceptions=True)


class GatewayProcess(Process):
    def __init__(self, tmp_path: Path, config: dict[str, Any], *extra: str):
        self.tmp_path = Path(tmp_path)
        self.config_path = self.tmp_path / "gateway.toml"
        self.write_config(config)
        super().__init__(["serve", "--config", str(self.config_path), *extra], self.tmp_path)
        self.url = ""

    def write_config(self, config: dict[str, Any] | str) -> None:
        self.config_path.write_text(config if isinstance(config, str) else toml(config))

    async def start(self) -> "GatewayProcess":
        await super().start()
        banner = (await self.wait_for("stdout", "kilnproxy serving"))[0]
        self.url = re.search(r"on (http://\S+)", banner).group(1)
        return self

    async def start_without_banner(self) -> "GatewayProcess":
        """Start a gateway expected to fail at start-up (then ``wait()`` for its exit code)."""
        await super().start()
        return self

    def access_log(self) -> list[dict]:
        return [json.loads(line) for line in self.lines["stdout"] if line.startswith("{")]

    def rows(self) -> list[dict]:
        db = sqlite3.connect(self.tmp_path / "usage.db")
        db.row_factory = sqlite3.Row
        try:
            return [dict(r) for r in db.execute("SELECT * FROM usage_events ORDER BY created_at, rowid")]
        finally:
            db.close()


class MockProcess(Process):
    def __init__(self, tmp_path: Path, port: int = 0):
        super().__init__(["mock-upstream", "--port", str(port)], Path(tmp_path))
        self.url = ""
        self.port = port

    async def start(self) -> "MockProcess":
        await super().start()
        line = (await self.wait_for("stdout", "mock upstream"))[0]
        self.url = re.search(r"on (http://\S+)", line).group(1)  # ends with /v1
        self.port = int(self.url.rsplit(":", 1)[1].split("/")[0])
        return self

    def kill(self) -> None:
        self.send(signal.SIGKILL)
