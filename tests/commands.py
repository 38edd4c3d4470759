"""``python -m kilnproxy ARGS`` as a user runs it, for the tests of the command line: ``start`` runs it in
``cwd`` (the checkout on ``PYTHONPATH``) until its output holds ``ready``; ``stop`` sends it Ctrl-C (SIGINT) and
checks that it exits 0."""

import asyncio
import os
import signal
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]


async def start(args, cwd, ready: bytes):
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kilnproxy", *args, cwd=cwd, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)})
    out = b""
    while ready not in out:
        line = await asyncio.wait_for(proc.stdout.readline(), 60)
        assert line, (out + await proc.stderr.read()).decode()
        out += line
    return proc, out


async def stop(proc):
    proc.send_signal(signal.SIGINT)
    assert await asyncio.wait_for(proc.wait(), 30) == 0
