"""Starting and stopping the benchmark's processes: every one is ended on the way out.

``Procs`` is a context manager; each process it starts runs in its own
process group, pinned to the CPUs asked for, and is stopped (SIGTERM, then
SIGKILL after a few seconds) when the ``with`` block ends, whatever way it ends.
"""

from __future__ import annotations

import os
import resource
import signal
import socket
import subprocess
import time
from pathlib import Path

FD_LIMIT = 65536


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def raise_fd_limit(want: int = FD_LIMIT) -> int:
    """Raise RLIMIT_NOFILE as far as allowed (root may raise the hard limit); return it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    for target in ((want, max(want, hard)), (min(want, hard), hard)):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, target)
            return target[0]
        except (ValueError, OSError):
            continue
    return soft


def peak_rss_kib(pid: int) -> tuple[int, int]:
    """(VmHWM, VmRSS) of a process, in KiB."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmHWM", "VmRSS"):
            fields[name] = int(value.split()[0])
    return fields["VmHWM"], fields["VmRSS"]


class Procs:
    def __init__(self, logdir: Path):
        self.logdir = logdir
        self.running: list[tuple[str, subprocess.Popen]] = []

    def __enter__(self) -> "Procs":
        return self

    def __exit__(self, *exc) -> None:
        self.stop_all()

    def start(self, name: str, argv: list[str], cpus: set[int] | None = None, port: int | None = None,
              env: dict | None = None, timeout: float = 20.0) -> subprocess.Popen:
        log = open(self.logdir / f"{name}.log", "ab")

        def setup() -> None:
            os.setpgrp()
            raise_fd_limit()
            if cpus:
                os.sched_setaffinity(0, cpus)

        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, preexec_fn=setup,
                                env={**os.environ, **(env or {})})
        log.close()
        self.running.append((name, proc))
        if port is not None:
            wait_for_port(port, proc, name, self.logdir / f"{name}.log", timeout)
        return proc

    def stop(self, proc: subprocess.Popen) -> None:
        self.running = [(n, p) for n, p in self.running if p is not proc]
        _stop(proc)

    def stop_all(self) -> None:
        while self.running:
            _, proc = self.running.pop()
            _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=8)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def wait_for_port(port: int, proc: subprocess.Popen, name: str, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode} at start-up:\n{log.read_text()[-2000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{name} did not listen on port {port} within {timeout:.0f} s")
