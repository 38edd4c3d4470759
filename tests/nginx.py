"""Debian's nginx in front of gateway replicas, as docs/replicas.md configures it, for tests.

``Nginx(folder, ports)`` writes docs/replicas.md's ``upstream`` and ``location``
blocks (plus what a process of its own needs: no daemon, its files in the
folder) and ``start()`` returns once it answers on its port. ``make nginx``
installs it.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import aiohttp

from kilnproxy.testing import free_port

NGINX = shutil.which("nginx") or "/usr/sbin/nginx"


def config(folder: Path, port: int, replicas: list[int]) -> str:
    servers = "\n".join(f"        server 127.0.0.1:{p} max_fails=1 fail_timeout=1s;" for p in replicas)
    return f"""
daemon off;
master_process off;
worker_processes 1;
pid {folder}/nginx.pid;
error_log {folder}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {folder}/body;
    proxy_temp_path {folder}/proxy;
    fastcgi_temp_path {folder}/fastcgi;
    uwsgi_temp_path {folder}/uwsgi;
    scgi_temp_path {folder}/scgi;
    upstream kilnproxy {{
        least_conn;
{servers}
        keepalive 64;
        keepalive_timeout 2s;
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://kilnproxy;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_read_timeout 600s;
        }}
    }}
}}
"""


class Nginx:
    def __init__(self, folder: Path, replicas: list[int]):
        self.folder = Path(folder)
        self.folder.mkdir(exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.conf = self.folder / "nginx.conf"
        self.conf.write_text(config(self.folder, self.port, replicas))
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> "Nginx":
        self.proc = await asyncio.create_subprocess_exec(NGINX, "-c", str(self.conf), "-e", str(self.folder / "error.log"),
                                                         stdout=asyncio.subprocess.DEVNULL,
                                                         stderr=asyncio.subprocess.DEVNULL)
        async with aiohttp.ClientSession() as s:
            for _ in range(2000):  # until it listens (a connection refused is answered at once)
                try:
                    async with s.get(f"{self.url}/healthz") as r:
                        if r.status == 200:
                            return self
                except aiohttp.ClientConnectionError:
                    assert self.proc.returncode is None, self.errors()
                    await asyncio.sleep(0.01)
        raise AssertionError(f"nginx did not start: {self.errors()}")

    def errors(self) -> str:
        log = self.folder / "error.log"
        return log.read_text() if log.exists() else ""

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.terminate()
            await self.proc.wait()
