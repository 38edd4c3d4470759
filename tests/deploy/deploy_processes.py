"""Real ``python -m kilnproxy`` processes for tests/deploy: run to the end, or serve until stopped.

``Served`` starts the gateway with the environment it is given, waits for its banner (the
line it prints once it listens; the bound URL is read from it) and keeps its output."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

BANNER = re.compile(r"kilnproxy (?:demo on|serving .* on) (http://\S+)")


def clean_environment(**variables: str) -> dict[str, str]:
    """This process's environment less any ``KILNPROXY*`` variable, plus ``variables``."""
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("KILNPROXY")}
    return {**env, "PYTHONUNBUFFERED": "1", **variables}


def run(args: list[str], cwd: Path, **variables: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kilnproxy", *args], cwd=cwd, env=clean_environment(**variables),
                          capture_output=True, text=True, timeout=60)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    def __init__(self, args: list[str], cwd: Path, **variables: str):
        self.args, self.cwd, self.env = args, cwd, clean_environment(**variables)
        self.proc: asyncio.subprocess.Process | None = None
        self.stdout: list[str] = []
        self.url = ""

    async def __aenter__(self) -> "Served":
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kilnproxy", *self.args, cwd=self.cwd, env=self.env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        while not self.url:
            line = await asyncio.wait_for(self.proc.stdout.readline(), 30)
            assert line, f"the gateway exited before listening: {(await self.proc.stderr.read()).decode()}"
            self.stdout.append(line.decode())
            if match := BANNER.search(line.decode()):
                self.url = match.group(1)
        return self

    async def stop(self) -> tuple[int, str]:
        """SIGTERM, then its exit code and what it wrote on stderr."""
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(self.proc.communicate(), 60)
        return self.proc.returncode, err.decode()

    async def __aexit__(self, *exc) -> None:
        if self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()
