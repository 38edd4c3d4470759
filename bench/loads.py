"""Load generators: wrk for M1-M3, M6 and M8, the aiohttp clients of ``clients.py`` for M4, M5 and M7."""

from __future__ import annotations

import json
import os
import re
import select
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Self

HERE = Path(__file__).resolve().parent
LUA = HERE / "post.lua"


class LoadError(RuntimeError):
    pass


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wrk(url: str, body: bytes, key: str, connections: int, seconds: float, pid: int | None = None,
        headers: dict[str, str] | None = None) -> dict:
    """One wrk run (one thread, on the CPUs this process is pinned to): its summary as a dict,
    with the CPU time the process ``pid`` spent per request (``cpu_us``) and its share of a core."""
    env = {**os.environ, "BENCH_BODY": body.decode(), "BENCH_KEY": key,
           "BENCH_HEADERS": "\n".join(f"{k}: {v}" for k, v in (headers or {}).items())}
    argv = ["wrk", "-t1", f"-c{connections}", f"-d{max(1, round(seconds))}s", "--timeout", "5s", "-s", str(LUA), url]
    cpu = cpu_seconds(pid) if pid else 0.0
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=seconds + 30)
    cpu = cpu_seconds(pid) - cpu if pid else 0.0
    line = next((l for l in out.stdout.splitlines() if l.startswith("BENCH ")), None)
    if out.returncode != 0 or line is None:
        raise LoadError(f"wrk failed on {url}: {out.stdout[-500:]} {out.stderr[-500:]}")
    summary = json.loads(line[6:])
    summary["rps"] = summary["requests"] / (summary["duration_us"] / 1e6)
    summary["cpu_us"] = cpu / max(summary["requests"], 1) * 1e6
    summary["cpu_share"] = cpu / (summary["duration_us"] / 1e6)
    summary["errors"] = sum(summary[k] for k in ("connect", "read", "write", "status", "timeout"))
    return summary


def stream_latency(url: str, body: bytes, key: str, n: int, concurrency: int,
                   headers: dict[str, str] | None = None) -> dict:
    """M4: per-stream time to first byte and total time, in ms (lists)."""
    argv = [sys.executable, str(HERE / "clients.py"), "latency", "--url", url, "--body", body.decode(),
            "--key", key, "-n", str(n), "--concurrency", str(concurrency)] + _header_args(headers)
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise LoadError(f"stream client failed on {url}: {out.stderr[-1500:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _header_args(headers: dict[str, str] | None) -> list[str]:
    return [a for k, v in (headers or {}).items() for a in ("--header", f"{k}: {v}")]


def hold_streams(url: str, body: bytes, key: str, n: int, processes: int, at_open, timeout: float,
                 headers: dict[str, str] | None = None) -> dict:
    """M5: ``n`` streams held open by ``processes`` clients. ``at_open()`` runs once all are
    open (or have failed) and must end them; returns ok/failed counts and what at_open returned."""
    share = [n // processes + (1 if i < n % processes else 0) for i in range(processes)]
    argv = [sys.executable, str(HERE / "clients.py"), "hold", "--url", url, "--body", body.decode(),
            "--key", key, "--concurrency", "64"] + _header_args(headers)
    procs = [subprocess.Popen(argv + ["-n", str(k)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for k in share]
    deadline = time.monotonic() + timeout
    try:
        opened = sum(_expect(p, "OPEN ", deadline) for p in procs)
        seen = at_open(opened)
        done = [json.loads(_expect(p, "DONE ", deadline, parse=False)) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    return {"opened": opened, "ok": sum(d["ok"] for d in done), "failed": sum(d["failed"] for d in done),
            "errors": [d["errors"] for d in done if d["errors"]], **seen}


def _expect(proc: subprocess.Popen, prefix: str, deadline: float, parse: bool = True):
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise LoadError(f"clients did not report {prefix.strip()} in time")
        ready, _, _ = select.select([proc.stdout], [], [], left)
        if not ready:
            continue
        line = proc.stdout.readline()
        if not line:
            raise LoadError(f"a client exited early: {proc.stderr.read()[-1500:]}")
        if line.startswith(prefix):
            rest = line[len(prefix):].strip()
            return int(rest) if parse else rest


def post(url: str, body: bytes = b"{}", key: str = "") -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=body, headers=headers, method="POST")
    with urllib.request.urlopen(req, timeout=30) as resp:
        return resp.status, resp.read()


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return json.loads(resp.read())


class MetricsPeaks:
    """Polls a gateway's ``/metrics`` in a thread while a load runs; ``peaks`` holds the highest value
    seen of each gauge ``name`` (its series whose labels contain ``match``).

        with MetricsPeaks(url, ("kilnproxy_upstream_queued_requests",), "127.0.0.1:9000") as m:
            ...  # the load
        m.peaks  # {"kilnproxy_upstream_queued_requests": 60.0}
    """

    def __init__(self, base_url: str, names: tuple[str, ...], match: str, every: float = 0.1):
        self.url, self.every = f"{base_url}/metrics", every
        self.lines = {name: re.compile(rf"^{name}{{[^}}]*{re.escape(match)}[^}}]*}} (\S+)$", re.MULTILINE) for name in names}
        self.peaks = {name: 0.0 for name in names}
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _poll(self) -> None:
        while not self._stop.wait(self.every):
            try:
                with urllib.request.urlopen(self.url, timeout=5) as resp:
                    text = resp.read().decode()
            except OSError:
                continue
            self.samples += 1
            for name, pattern in self.lines.items():
                for value in pattern.findall(text):
                    self.peaks[name] = max(self.peaks[name], float(value))
