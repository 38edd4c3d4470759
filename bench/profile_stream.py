"""Where the gateway's CPU goes during M3: py-spy samples of kilnproxy relaying 64-chunk streams.

Starts nginx with the canned stream and kilnproxy (every feature on, pinned to
CPU 0), runs wrk -c32 on the stream for ``--seconds`` while ``py-spy record``
samples the gateway, and prints the CPU time per stream (from ``/proc``: the
event loop's thread, and the others) and the event loop thread's samples as
microseconds per stream: by part (what they pay for) and for the functions
that take the most (inclusive, and their own). ``--plugin`` loads a plugin module (e.g.
``plugins/noop_event.py``); ``--responses`` runs M8's Responses API stream instead (72 ``event:`` +
``data:`` pairs, 64 text deltas, through ``framed_relay.py``). Needs py-spy (``pip install py-spy``), nginx and wrk.

    python bench/profile_stream.py [--seconds 10] [--plugin plugins/noop_event.py] [--responses] [--raw out.txt]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from loads import wrk
from procs import Procs, free_port, raise_fd_limit
from run import KEY, PY, gateway_config
from upstreams import CHUNKS, RESPONSES_EVENTS, request_body, responses_body, write_nginx_files

HERE = Path(__file__).resolve().parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--plugin", help="a plugin module for the gateway to load")
    parser.add_argument("--responses", action="store_true", help="M8's Responses API stream instead of M3's")
    parser.add_argument("--raw", help="also keep py-spy's collapsed stacks in this file")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    py_spy = shutil.which("py-spy") or str(Path(PY).with_name("py-spy"))
    cpus = sorted(os.sched_getaffinity(0))
    gw_cpus = {cpus[0]} if len(cpus) >= 2 else None
    if gw_cpus:
        os.sched_setaffinity(0, {cpus[1]})
    raise_fd_limit()
    work = Path(tempfile.mkdtemp(prefix="kilnproxy-profile-"))
    try:
        with Procs(work) as procs:
            nginx_port, port = free_port(), free_port()
            conf = write_nginx_files(nginx_port, work)
            procs.start("nginx", ["nginx", "-e", str(work / "nginx-error.log"), "-c", str(conf)], port=nginx_port)
            nginx = f"http://127.0.0.1:{nginx_port}"
            plugin = str(Path(args.plugin).resolve()) if args.plugin else None
            cfg = gateway_config(work / "gw.toml", work / "gw.db", port,
                                 {"bench-stream": f"{nginx}/sse/v1",
                                  "bench-responses": {"url": f"{nginx}/sse/v1", "endpoints": ["responses"]}}, plugin)
            gw = procs.start("kilnproxy", [PY, "-m", "kilnproxy", "serve", "--config", str(cfg)], cpus=gw_cpus,
                             port=port)
            if args.responses:
                url, body, events = f"http://127.0.0.1:{port}/v1/responses", responses_body(), RESPONSES_EVENTS
            else:
                url, body, events = f"http://127.0.0.1:{port}/v1/completions", request_body(True, model="bench-stream"), CHUNKS + 2
            wrk(url, body, KEY, 32, 2)  # warm-up
            raw = work / "raw.txt"
            spy = subprocess.Popen([py_spy, "record", "-p", str(gw.pid), "-d", str(int(args.seconds)), "-r", "250",
                                    "--format", "raw", "-o", str(raw)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            main0 = cpu_seconds(gw.pid, gw.pid)
            summary = wrk(url, body, KEY, 32, args.seconds, gw.pid)
            main = (cpu_seconds(gw.pid, gw.pid) - main0) / summary["requests"] * 1e6
            spy.wait()
            per_stream = summary["cpu_us"]
            print(f"{summary['requests']} streams, {summary['rps'] * CHUNKS:.0f} chunks/s, "
                  f"{per_stream:.0f} µs CPU per stream ({per_stream / events:.2f} µs per event), "
                  f"CPU share {summary['cpu_share'] * 100:.0f}%; the event loop's thread {main:.0f} µs, the "
                  f"others (the ledger's SQLite thread, the access log's writer) {per_stream - main:.0f} µs")
            if args.raw:
                shutil.copy(raw, args.raw)
            report(raw.read_text(), main, args.top)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def cpu_seconds(pid: int, tid: int) -> float:
    """User + system CPU time of one thread so far."""
    fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def report(raw: str, per_stream: float, top: int) -> None:
    """The event loop thread's samples, by part and per function, as µs per stream: its samples
    scaled to its CPU time (the other threads' samples include waits on the disk, not CPU)."""
    raw = "\n".join(line for line in raw.splitlines() if "threading.py" not in line)
    inclusive, own, total = Counter(), Counter(), 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        frames = [_name(f) for f in stack.split(";")]
        total += n
        for name in set(frames):
            inclusive[name] += n
        own[frames[-1]] += n
    if not total:
        print("py-spy recorded nothing")
        return
    scale = per_stream / total
    print("\nby part: µs per stream (% of samples)")
    for name, n in parts(raw).most_common():
        print(f"  {n * scale:8.1f}  {n / total * 100:5.1f}%  {name}")
    for title, counts in (("inclusive", inclusive), ("own", own)):
        print(f"\n{title}: µs per stream (% of samples)")
        for name, n in counts.most_common(top):
            print(f"  {n * scale:8.1f}  {n / total * 100:5.1f}%  {name}")


RELAY_CHUNK = {"feed_chunk", "_forward", "_tail_start", "close"}


def parts(raw: str) -> Counter:
    """Samples by what they pay for: the frame nearest the leaf that belongs to kilnproxy decides
    (aiohttp's own frames under the stream's loop are its reads and writes)."""
    out = Counter()
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if stack:
            out[_part([_name(f) for f in stack.split(";")])] += int(count)
    return out


# EventRelay and the parts it inherits from, one module each
PLAIN_RELAY = ('kilnproxy/proxy/relay/plain_relay.py',
               'kilnproxy/proxy/relay/plain_decider.py',
               'kilnproxy/proxy/relay/plain_transforms.py',
               'kilnproxy/proxy/relay/plain_bookkeeping.py',
               'kilnproxy/proxy/relay/event_plugins.py')


def _part(frames: list[str]) -> str:
    runner = [i for i, name in enumerate(frames) if name.endswith(":Runner.run")]
    frames = frames[runner[0] + 1:] if runner else frames  # below the loop: what it runs
    if not frames:
        return "event loop and the rest"
    leaf = frames[-1]
    for name in reversed(frames):
        path, _, func = name.partition(":")
        if path == "kilnproxy/proxy/relay/plain_scanner.py":
            return "relay: checks of whole runs (PlainRun)"
        if path in PLAIN_RELAY and func.split(".")[-1] in RELAY_CHUNK:
            return "relay: per chunk (tail, rename, count)"
        if path in PLAIN_RELAY or path == "kilnproxy/sse.py":
            return "relay: events read one by one (finish, usage, [DONE]) and the usage chunk"
        if path == "kilnproxy/proxy/relay/framed_relay.py":
            return "relay: the framed relay (runs, frames read one by one)"
        if path in ("kilnproxy/proxy/stream_writer.py", "kilnproxy/proxy/framed_writer.py"):
            if "http_writer" in leaf or "web_response" in leaf:
                return "stream: writes to the client"
            if "streams.py" in leaf or "client_proto" in leaf:
                return "stream: reads from the upstream"
            return "stream: prepare, keep-alive, submit, end"
        if path.startswith("aiosqlite/") or path == "kilnproxy/store/sqlite/ledger.py":
            return "ledger (SQLite thread and its queue)"
        if path.startswith("kilnproxy/"):
            return "request path before the stream (auth, admission, body, upstream request, record)"
    if any("client_proto" in f or "aiohttp/client" in f or "streams.py" in f for f in frames[-3:]):
        return "upstream connection (aiohttp client, outside the handler)"
    if any("web_protocol" in f or "http_parser" in f or "web_" in f for f in frames[-3:]):
        return "server connection (aiohttp server, outside the handler)"
    return "event loop and the rest"


def _name(frame: str) -> str:
    """``write (aiohttp/web_response.py:123)`` -> ``aiohttp/web_response.py:write``."""
    func, _, where = frame.partition(" (")
    path = where.rsplit(":", 1)[0]
    for marker in ("site-packages/", "lib/python3.11/", "/work/"):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    return f"{path}:{func}"


if __name__ == "__main__":
    sys.exit(main())
