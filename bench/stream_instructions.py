"""Instructions a stream costs the gateway, counted by valgrind (callgrind): a same-machine figure no
other load moves.

Starts nginx with M3's canned stream and each kilnproxy tree under ``valgrind --tool=callgrind``
(every feature on, as ``ab.py`` configures it), sends ``--warm`` streams, zeroes the counters,
sends ``--streams`` more (on ``--concurrency`` kept-alive connections, each read to its end), dumps the counters
and prints the user-space instructions per stream (the kernel's work, such as the system calls'
own, is not counted; valgrind runs the process about 50 times slower, so the timing of the
ledger's group commits and of the keep-alive differ from a real run). Needs valgrind and nginx.

    python bench/stream_instructions.py before=/tmp/before after=installed [--streams 400] [--concurrency 8]

``--json``: M2's non-streamed request instead (the canned JSON completion), instructions a request.

``--stores sqlite,pg``: each tree once per usage store, SQLite and PostgreSQL (``[storage] url``: a
throw-away server from Debian's packages, ``kilnproxy.testing.postgres``, fsync on, each gateway a fresh
database of its own), in the order given. PostgreSQL's own instructions are not counted, only the
gateway's (its asyncpg side: the arguments encoded, the results decoded, the batching).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from procs import Procs, free_port
from run import KEY, gateway_config
from upstreams import request_body, write_nginx_files

HERE = Path(__file__).resolve().parent


async def streams(port: int, count: int, concurrency: int, body: bytes, stream: bool = True) -> None:
    """``count`` streams (or JSON answers) on ``concurrency`` kept-alive connections (as wrk sends them),
    each read to its end."""
    data = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
            + b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    left = iter(range(count))

    async def worker() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            for _ in left:
                writer.write(data)
                head = await reader.readuntil(b"\r\n\r\n")
                if not stream:
                    length = int(re.search(rb"(?i)content-length: (\d+)", head).group(1))
                    assert head.startswith(b"HTTP/1.1 200"), head
                    assert b'"cost"' in await reader.readexactly(length)
                    continue
                assert head.startswith(b"HTTP/1.1 200") and b"Transfer-Encoding: chunked" in head, head
                body = await reader.readuntil(b"\r\n0\r\n\r\n")
                assert b"data: [DONE]" in body, body[-200:]
        finally:
            writer.close()
    await asyncio.gather(*(worker() for _ in range(concurrency)))


def wait_port(port: int, seconds: float = 600) -> None:
    import socket
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise RuntimeError(f"nothing listens on {port}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("variants", nargs="+", metavar="NAME=TREE")
    parser.add_argument("--streams", type=int, default=400)
    parser.add_argument("--warm", type=int, default=100)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--plugin", metavar="PATH")
    parser.add_argument("--json", action="store_true", help="M2's non-streamed request instead of M3's stream")
    parser.add_argument("--stores", default="sqlite", help="sqlite, pg or both (sqlite,pg): each tree on each")
    args = parser.parse_args()
    stores = args.stores.split(",")
    assert set(stores) <= {"sqlite", "pg"}, args.stores
    variants = dict(v.split("=", 1) for v in args.variants)
    work = Path(tempfile.mkdtemp(prefix="kilnproxy-ir-"))
    os.chdir(work)
    stream = not args.json
    body = request_body(stream, model="bench-stream" if stream else "bench")
    plugin = str(Path(args.plugin).resolve()) if args.plugin else None
    postgres = None
    if "pg" in stores:
        sys.path.insert(0, str(HERE.parent))
        from kilnproxy.testing.postgres import PostgresServer
        postgres = PostgresServer(fsync=True)
        postgres.start()
    runs = [(f"{name}/{store}" if len(stores) > 1 else name, tree, store)
            for name, tree in variants.items() for store in stores]
    with Procs(work) as procs:
        nginx_port = free_port()
        procs.start("nginx", ["nginx", "-e", str(work / "nginx-error.log"), "-c",
                              str(write_nginx_files(nginx_port, work))], port=nginx_port)
        for number, (name, tree, store) in enumerate(runs):
            port = free_port()
            file = name.replace("/", "-")
            storage = None
            if store == "pg":
                url = postgres.create_database(f"kiln_ir_{number}")
                storage = f'url = "{url}"\nspool_path = "{work / file}-spool.db"\nreplica_timeout_seconds = 15'
            config = gateway_config(work / f"{file}.toml", work / f"{file}.db", port,
                                    {"bench-stream": f"http://127.0.0.1:{nginx_port}/sse/v1",
                                     "bench": f"http://127.0.0.1:{nginx_port}/json/v1"}, plugin=plugin,
                                    storage=storage)
            tree = str(HERE.parent) if tree == "installed" else str(Path(tree).resolve())
            out = work / f"{file}.callgrind"
            proc = subprocess.Popen(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
                                     sys.executable, "-m", "kilnproxy", "serve", "--config", str(config)],
                                    env={**os.environ, "PYTHONPATH": tree, "PYTHONHASHSEED": "0"},
                                    stdout=subprocess.DEVNULL, stderr=open(work / f"{file}.log", "w"))
            try:
                wait_port(port)
                asyncio.run(streams(port, args.warm, args.concurrency, body, stream))
                subprocess.run(["callgrind_control", "-z", str(proc.pid)], check=True, capture_output=True)
                asyncio.run(streams(port, args.streams, args.concurrency, body, stream))
                subprocess.run(["callgrind_control", "-d", str(proc.pid)], check=True, capture_output=True)
            finally:
                proc.terminate()
                proc.wait()
            match = re.search(r"^summary: (\d+)", (work / f"{file}.callgrind.1").read_text(errors="replace"), re.M)
            totals = int(match.group(1))  # the counters' dump: from the zeroing to it
            what = "stream" if stream else "JSON request"
            print(f"{name:16s} {totals / args.streams:12,.0f} instructions a {what} ({args.streams} {what}s, "
                  f"{args.concurrency} at a time)", flush=True)
    if postgres is not None:
        postgres.remove()


if __name__ == "__main__":
    main()
