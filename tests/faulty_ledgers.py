"""For the tests of a ledger whose disk misbehaves under a running gateway (store/): ``mounted`` mounts a
small file system of the test's own and unmounts it whatever happens, ``fill`` fills one up; ``post``,
``health`` and ``metric`` read what the gateway answers, /healthz and /metrics say."""

import contextlib
import os
import subprocess
from pathlib import Path

import aiohttp

from kilnproxy.testing import KEY


GEN = "X-Neocloud-Generation-Id"


AUTH = {"Authorization": f"Bearer {KEY}"}


@contextlib.contextmanager
def mounted(point: Path, *args: str):
    """``mount ARGS POINT``; unmounted on the way out, whatever happened (lazily if still busy)."""
    point.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", *args, str(point)], check=True, capture_output=True)
    try:
        yield point
    finally:
        if subprocess.run(["umount", str(point)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(point)], capture_output=True)


def fill(folder: Path) -> Path:
    """Write zeros into ``folder`` until its file system is full; the file written."""
    filler = folder / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        while True:
            os.write(fd, bytes(65536))
    except OSError:
        pass
    try:
        while True:  # the last partial pages
            os.write(fd, bytes(512))
    except OSError:
        pass
    finally:
        os.close(fd)
    return filler


async def post(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, str | None, bytes]:
    async with session.post(f"{url}/v1/completions", json=body, headers=AUTH) as resp:
        return resp.status, resp.headers.get(GEN), await resp.read()


async def metric(session: aiohttp.ClientSession, url: str, name: str) -> float:
    async with session.get(f"{url}/metrics") as resp:
        for line in (await resp.text()).splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


async def health(session: aiohttp.ClientSession, url: str) -> tuple[dict, int]:
    async with session.get(f"{url}/healthz") as resp:
        body = await resp.json()
    async with session.get(f"{url}/healthz?ready") as resp:
        return body, resp.status
