"""Where a request's CPU time goes, by feature: py-spy on the gateway under the loads of M1-M3.

Starts nginx with the bench's canned answers, the pass-through and kilnproxy (every
feature on, pinned like ``run.py`` pins them), and for each load records the process
under test with py-spy (``--nonblocking``: the process is never paused) while wrk runs.
Only the thread holding the GIL is sampled (``--gil``), so waiting is never counted.
Each sample's stack is charged to the feature of its innermost frame that belongs to
one (a frame of asyncio, aiohttp's stream buffers and the like defers to its caller),
and each feature's share of the samples times the CPU time per request (from
``/proc``; the GIL's wall time overstates CPU on a shared core) gives microseconds
per request. Writes ``results/profile-<date>-<label>.md``, and the raw stacks (py-spy's
collapsed format, for a flame graph) to ``results/raw/``.

    python bench/profile.py [--label after] [--seconds 8] [--only M1,M2,M3] [--tracing]

``--tree DIR`` profiles another checkout of kilnproxy (e.g. an older commit exported
with ``git archive``), imported from DIR instead of the installed package.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from loads import cpu_seconds, wrk
from procs import Procs, free_port
from report import machine, table
from run import KEY, gateway_config
from upstreams import CHUNKS, request_body, write_nginx_files

HERE = Path(__file__).resolve().parent
PY = sys.executable
RATE = 1000  # samples per second, of the thread that holds the GIL (``--gil``): CPU time spent in Python

# (feature, path fragments of the frames that belong to it); the first feature matched
# from the innermost frame outwards takes the sample.
FEATURES = [
    ("usage row and ledger (row, group commit, SQLite thread, checkpoints)",
     ("kilnproxy/proxy/request_record.py", "kilnproxy/store/sqlite/ledger.py", "kilnproxy/store/sqlite/checkpoint.py", "kilnproxy/store/sqlite/loop_commits.py",
      "kilnproxy/store/batches.py", "aiosqlite/", "sqlite3/", "kilnproxy/proxy/gateway.py")),
    ("metrics and access log (ops)", ("kilnproxy/ops/metrics.py", "kilnproxy/ops/accesslog.py", "prometheus_client/")),
    ("tracing (spans, OTLP encoding, exporter thread)",
     ("kilnproxy/ops/tracing/install.py", "kilnproxy/ops/tracing/otlp_wire.py", "kilnproxy/ops/tracing/context.py",
      "kilnproxy/ops/tracing/export.py")),
    ("auth and admission, steps 1-7 (key, credits, body parse, model, slot, stream, params)",
     ("kilnproxy/proxy/rules.py", "kilnproxy/proxy/tenancy/auth.py", "kilnproxy/proxy/request_body.py",
      "kilnproxy/store/limits.py", "kilnproxy/call.py")),
    ("steps 8-9, plugins (include_usage, upstream_model, hooks)",
     ("kilnproxy/plugins/manager.py", "kilnproxy/plugins/builtin/", "pluggy/")),
    ("stream relay (events, usage chunk, keepalive)",
     ("kilnproxy/proxy/relay/plain_", "kilnproxy/proxy/relay/event_plugins.py", "kilnproxy/proxy/stream_writer.py", "kilnproxy/proxy/relay/plain_scanner.py",
      "kilnproxy/proxy/relay/usage_chunk.py", "kilnproxy/sse.py")),
    ("answer: model name, usage.cost, finish reason", ("kilnproxy/usage.py", "json_answer")),
    ("upstream HTTP client (route, aiohttp client, connection pool, read timer)",
     ("kilnproxy/proxy/upstream/routes.py", "kilnproxy/proxy/upstream/client.py", "kilnproxy/proxy/upstream/connections.py",
      "kilnproxy/proxy/upstream/responses.py", "httptools/", "aiohttp/client", "aiohttp/connector.py", "aiohttp/tracing.py",
      "aiohttp/cookiejar.py", "aiohttp/http_parser.py", "aiohttp/_http_parser", "aiohttp/tcp_helpers.py",
      "aiohttp/base_protocol.py", "yarl/")),
    ("routing and middlewares (router or route table, JSON errors, shutdown count)",
     ("aiohttp/web_app.py", "aiohttp/web_urldispatcher.py", "aiohttp/web_middlewares.py",
      "kilnproxy/web/fastpath.py", "kilnproxy/web/app.py", "kilnproxy/ops/lifecycle.py")),
    ("HTTP server (aiohttp: request objects, response headers and writes)",
     ("aiohttp/web_protocol.py", "aiohttp/web_response.py", "aiohttp/http_writer.py", "aiohttp/web_request.py",
      "aiohttp/web_server.py", "aiohttp/abc.py", "kilnproxy/answers.py")),
    ("the request handler itself (generation id, the steps' calls, headers)",
     ("kilnproxy/proxy/endpoints/completions.py", "kilnproxy/proxy/forward.py", "kilnproxy/proxy/request_path.py",
      "kilnproxy/errors.py")),
]
OTHER = "event loop and the rest (asyncio, uvloop callbacks, GC)"


def feature_of(stack: list[str]) -> str:
    for frame in reversed(stack):  # innermost first
        for feature, fragments in FEATURES:
            if any(f in frame for f in fragments):
                return feature
    return OTHER


def summarise(raw: Path) -> collections.Counter:
    counts: collections.Counter = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if stack:
            counts[feature_of(stack.split(";"))] += int(n)
    return counts


def record(pid: int, out: Path, seconds: float, load) -> dict:
    """Run ``load()`` (wrk) while py-spy records ``pid``; the load's summary."""
    spy = subprocess.Popen(["py-spy", "record", "--gil", "--nonblocking", "-r", str(RATE), "-f", "raw", "-d",
                            str(int(seconds) + 2), "-p", str(pid), "-o", str(out)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        summary = load()
    finally:
        _, err = spy.communicate(timeout=60)
    if spy.returncode != 0 or not out.exists():
        raise RuntimeError(f"py-spy failed: {err[-500:]}")
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", default="now", help="names the results file")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--only", default="M1,M2,M3")
    parser.add_argument("--tracing", action="store_true",
                        help="kilnproxy with [tracing] on, every trace kept, spans sent to otlp_sink.py")
    parser.add_argument("--tree", help="profile the kilnproxy package of this folder instead of the installed one")
    parser.add_argument("--out", default=str(HERE / "results"))
    args = parser.parse_args()
    if shutil.which("py-spy") is None and not (Path(PY).parent / "py-spy").exists():
        print("py-spy is not installed: pip install py-spy", file=sys.stderr)
        return 1
    os.environ["PATH"] = f"{Path(PY).parent}:{os.environ['PATH']}"
    cpus = sorted(os.sched_getaffinity(0))
    gw_cpus, load_cpus = ({cpus[0]}, {cpus[1]}) if len(cpus) >= 2 else (None, None)
    if load_cpus:
        os.sched_setaffinity(0, load_cpus)
    env = {"PYTHONPATH": args.tree} if args.tree else None
    work = Path(tempfile.mkdtemp(prefix="kilnproxy-profile-"))
    started = datetime.datetime.now(datetime.timezone.utc)
    stem = f"profile-{started:%Y-%m-%d-%H%M}-{args.label}"
    out = Path(args.out)
    (out / "raw").mkdir(parents=True, exist_ok=True)
    loadavg = open("/proc/loadavg").read().split()[:3]
    sections = []
    with Procs(work) as procs:
        nginx_port = free_port()
        conf = write_nginx_files(nginx_port, work)
        procs.start("nginx", ["nginx", "-e", str(work / "nginx-error.log"), "-c", str(conf)], port=nginx_port)
        nginx = f"http://127.0.0.1:{nginx_port}"
        gw_port, pt_port = free_port(), free_port()
        tables = ""
        if args.tracing:
            sink_port = free_port()
            procs.start("otlp-sink", [PY, str(HERE / "otlp_sink.py"), "--port", str(sink_port)], cpus=load_cpus,
                        port=sink_port)
            tables = (f'\n[tracing]\nenabled = true\nendpoint = "http://127.0.0.1:{sink_port}/v1/traces"\n'
                      'sample_ratio = 1.0\n')
        cfg = gateway_config(work / "gw.toml", work / "gw.db", gw_port,
                             {"bench": f"{nginx}/json/v1", "bench-stream": f"{nginx}/sse/v1"}, sections=tables)
        gw = procs.start("kilnproxy", [PY, "-m", "kilnproxy", "serve", "--config", str(cfg)], cpus=gw_cpus,
                         port=gw_port, env=env)
        pt = procs.start("pass-through", [PY, str(HERE / "passthrough.py"), "--port", str(pt_port), "--upstream",
                                          nginx], cpus=gw_cpus, port=pt_port)
        loads = {"M1": (request_body(False), 1, "/json/v1/completions", 1),
                 "M2": (request_body(False), 64, "/json/v1/completions", 1),
                 "M3": (request_body(True, model="bench-stream"), 32, "/sse/v1/completions", CHUNKS)}
        for name in args.only.upper().split(","):
            body, conns, pt_path, _ = loads[name]
            rows, per_request = [], {}
            for target, proc, url in (("kilnproxy", gw, f"http://127.0.0.1:{gw_port}/v1/completions"),
                                      ("pass-through", pt, f"http://127.0.0.1:{pt_port}{pt_path}")):
                wrk(url, body, KEY, conns, 1)  # warm-up
                raw = out / "raw" / f"{stem}-{name}-{target}.txt"
                summary = record(proc.pid, raw, args.seconds,
                                 lambda: wrk(url, body, KEY, conns, args.seconds, proc.pid))
                per_request[target] = (summarise(raw), summary)
            unit = "stream" if name == "M3" else "request"
            us = {}  # target -> feature -> µs per request: its share of the GIL samples x CPU per request
            for target, (counts, summary) in per_request.items():
                total = sum(counts.values()) or 1
                us[target] = {f: n / total * summary["cpu_us"] for f, n in counts.items()}
            for feature in [f for f, _ in FEATURES] + [OTHER]:
                g, p = us["kilnproxy"].get(feature, 0), us["pass-through"].get(feature, 0)
                if g or p:
                    rows.append([feature, f"{g:.1f}", f"{p:.1f}" if p else "", f"{g - p:+.1f}"])
            g_cpu, p_cpu = (per_request[t][1]["cpu_us"] for t in ("kilnproxy", "pass-through"))
            rows.append([f"**CPU per {unit} (/proc)**", f"**{g_cpu:.1f}**", f"**{p_cpu:.1f}**",
                         f"**{g_cpu - p_cpu:+.1f}**"])
            sections.append(f"## {name} ({conns} in flight{', streamed' if name == 'M3' else ''})\n\n"
                            + table(["feature", f"kilnproxy µs per {unit}", f"pass-through µs per {unit}",
                                     "difference"], rows))
    text = "\n\n".join([f"# kilnproxy profile ({args.label}), {started:%Y-%m-%d %H:%M} UTC",
                        machine() + f"\n- load average at start {' '.join(loadavg)}; py-spy {args.seconds:g} s "
                        f"per load at {RATE} Hz of the thread holding the GIL (`--gil --nonblocking`: "
                        "idle time is not sampled); a feature's µs = its share of the samples x the CPU time "
                        "per request read from /proc (so time outside the GIL, in the kernel's sockets and "
                        "SQLite's C code, is spread in proportion); kilnproxy " + (args.tree or "installed"),
                        *sections]) + "\n"
    (out / f"{stem}.md").write_text(text)
    print(text)
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
