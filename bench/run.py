"""``make bench``: what kilnproxy adds to a request, measured against the thinnest pass-through.

Starts, on 127.0.0.1 only, nginx with canned answers, the mock upstream, a
slow upstream, the pass-through of ``passthrough.py``, kilnproxy with every
feature on (auth, in-flight limit, SQLite usage ledger, cost) and the peers of
``peers.py`` that can be installed (Portkey, LiteLLM), runs M1-M8 alternating
the targets round by round, PG, and M9 (``m9_routing.py``: the routing
policies side by side on multi-turn conversations, on servers and gateway
replicas of its own), prints the tables and writes them to a file of the run's
own: ``bench/results/<date>-<time>.md`` for a full run,
``bench/results/partial/<date>-<time>-<measures>.md`` for a partial one (which
so never replaces the last full table). Every process it started is stopped on
the way out. The gateway, the pass-through and the peers run on CPU 0; load
generators and upstreams on CPU 1.

    python bench/run.py [--rounds 5] [--seconds 3] [--streams 10000] [--only M1,M5,M9] [--peers portkey]
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import sys
import tempfile
from pathlib import Path

import m9_routing
import measure_pg
import peers
from loads import LoadError, post
from measures import Bench
from procs import Procs, free_port, raise_fd_limit
from report import machine
from upstreams import UPSTREAM_MODEL, request_body, write_nginx_files

from kilnproxy.testing.postgres import PostgresServer

HERE = Path(__file__).resolve().parent
ALL = ("M1", "M2", "M3", "M4", "M5", "M6", "M7", "M8", "PG", "M9")
PY = sys.executable
KEY = "sk-bench"


def model_lines(spec: str | dict) -> str:
    """A model's upstream and extra lines: ``spec`` is the upstream's base URL, or a dict with ``url``,
    ``max_in_flight`` (an upstream with slots), ``queue_timeout`` and ``endpoints`` (the APIs it answers),
    or with ``urls`` (several upstreams) and ``routing``."""
    if isinstance(spec, str):
        return f'upstreams = ["{spec}"]'
    if "urls" in spec:
        return "upstreams = [" + ", ".join(f'"{u}"' for u in spec["urls"]) + f']\nrouting = "{spec["routing"]}"'
    slots = f", max_in_flight = {spec['max_in_flight']}" if "max_in_flight" in spec else ""
    lines = [f'upstreams = [{{url = "{spec["url"]}"{slots}}}]']
    if "queue_timeout" in spec:
        lines.append(f"queue_timeout = {spec['queue_timeout']}")
    if "endpoints" in spec:
        lines.append("endpoints = [" + ", ".join(f'"{e}"' for e in spec["endpoints"]) + "]")
    return "\n".join(lines)


def gateway_config(path: Path, db: Path, port: int, upstreams: dict[str, str | dict], plugin: str | None = None,
                   storage: str | None = None, per_minute: bool = False, sections: str = "") -> Path:
    """``sections``: more TOML tables, appended as they are (e.g. ``[tracing]``)."""
    models = "".join(f"""
[[models]]
id = "{model}"
{model_lines(spec)}
upstream_model = "{UPSTREAM_MODEL}"
context_window = 32768
[models.pricing]
prompt = 0.10
completion = 0.30
""" for model, spec in upstreams.items())
    path.write_text(f"""
[server]
host = "127.0.0.1"
port = {port}

[storage]
{storage or f'path = "{db}"'}

[limits]
max_in_flight_per_org = 100000
{models}
[[orgs]]
id = "bench"
credits = 1000000000.0
{"requests_per_minute = 1000000000" + chr(10) + "tokens_per_minute = 1000000000000" if per_minute else ""}

[[keys]]
key = "{KEY}"
org = "bench"

[plugins]
modules = [{f'"{plugin}"' if plugin else ""}]
entry_points = false
{sections}""")
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds per measurement, the order reversed every other round")
    parser.add_argument("--seconds", type=float, default=3.0, help="length of one wrk run")
    parser.add_argument("--streams", type=int, default=10000, help="M5: streams held open at once")
    parser.add_argument("--only", default=",".join(ALL), help="comma-separated measurements")
    parser.add_argument("--peers", default="portkey,litellm", help="peers to measure beside kilnproxy ('' for none)")
    parser.add_argument("--out", default=str(HERE / "results"), help="folder of the results files")
    parser.add_argument("--nice", type=int, default=-10,
                        help="scheduling priority of everything the bench starts (a shared machine's other "
                             "work then takes less of the pinned cores)")
    args = parser.parse_args()
    only = set(args.only.upper().split(","))
    full = set(ALL) <= only
    cpus = sorted(os.sched_getaffinity(0))
    gw_cpus, load_cpus = ({cpus[0]}, {cpus[1]}) if len(cpus) >= 2 else (None, None)
    if load_cpus:
        os.sched_setaffinity(0, load_cpus)  # wrk, clients and upstreams inherit this
    raise_fd_limit()
    try:
        os.setpriority(os.PRIO_PROCESS, 0, args.nice)  # inherited by every process started below
    except (PermissionError, OSError):
        args.nice = os.getpriority(os.PRIO_PROCESS, 0)
    work = Path(tempfile.mkdtemp(prefix="kilnproxy-bench-"))
    print(f"kilnproxy bench: logs and databases in {work}", flush=True)
    started = datetime.datetime.now(datetime.timezone.utc)
    with Procs(work) as procs:
        ports = {name: free_port() for name in ("nginx", "mock")}
        conf = write_nginx_files(ports["nginx"], work)
        pids = {}  # base URL -> pid, for the CPU time each spends
        pids[f"http://127.0.0.1:{ports['nginx']}"] = procs.start(
            "nginx", ["nginx", "-e", str(work / "nginx-error.log"), "-c", str(conf)], port=ports["nginx"]).pid
        procs.start("mock", [PY, "-m", "kilnproxy", "mock-upstream", "--port", str(ports["mock"]),
                             "--delay", "0.005"], port=ports["mock"])
        nginx = f"http://127.0.0.1:{ports['nginx']}"
        mock = f"http://127.0.0.1:{ports['mock']}"
        upstreams = {"bench": f"{nginx}/json/v1", "bench-stream": f"{nginx}/sse/v1", "bench-mock": f"{mock}/v1",
                     "bench-embed": {"url": f"{nginx}/json/v1", "endpoints": ["embeddings"]},
                     "bench-responses": {"url": f"{nginx}/sse/v1", "endpoints": ["responses"]}}

        def gateway(name: str, plugin: str | None = None, argv_head: list[str] | None = None,
                    extra: dict[str, str | dict] | None = None, storage: str | None = None,
                    per_minute: bool = False, sections: str = "") -> str:
            port = free_port()
            cfg = gateway_config(work / f"{name}.toml", work / f"{name}.db", port, {**upstreams, **(extra or {})},
                                 plugin, storage, per_minute, sections)
            head = argv_head or [PY, "-m", "kilnproxy", "serve"]
            url = f"http://127.0.0.1:{port}"
            pids[url] = procs.start(name, head + ["--config", str(cfg)], cpus=gw_cpus, port=port).pid
            return url

        def passthrough(name: str, upstream: str) -> str:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            pids[url] = procs.start(name, [PY, str(HERE / "passthrough.py"), "--port", str(port), "--upstream",
                                           upstream], cpus=gw_cpus, port=port).pid
            return url

        installers = {"portkey": (peers.PORTKEY, peers.install_portkey), "litellm": (peers.LITELLM, peers.install_litellm)}
        commands = {}
        for wanted in filter(None, args.peers.lower().split(",")):
            name, install = installers[wanted]
            argv = install()
            if argv:
                commands[name] = argv

        def peer(name: str, models: dict[str, str]) -> str:
            """A new process of peer ``name`` on the gateway's CPU; its base URL."""
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            slug = name.lower() + (f"-{len(pids)}" if models else "")
            if name == peers.PORTKEY:
                argv, env = commands[name] + [f"--port={port}"], {"NODE_ENV": "production"}
            else:
                cfg = peers.litellm_config(work / f"{slug}.yaml", {**litellm_models, **models}, UPSTREAM_MODEL)
                argv, env = commands[name] + ["--config", str(cfg), "--port", str(port)], peers.LITELLM_ENV
            pids[url] = procs.start(slug, argv, cpus=gw_cpus, port=port, env=env, timeout=180).pid
            return url

        litellm_models = {"bench": f"{nginx}/json/v1", "bench-stream": f"{nginx}/sse/v1", "bench-mock": f"{mock}/v1"}
        bench = Bench(args, procs, KEY, pids, nginx=nginx, mock=mock, gateway=gateway, passthrough=passthrough,
                      peer=peer, peers=list(commands))
        try:
            bench.check()
            for name in ("M1", "M2", "M3", "M4", "M6", "M7", "M8", "M5"):  # M5 last: it restarts what it measures
                if name in only:
                    print(f"\n{name} ...", flush=True)
                    before = len(bench.sections)
                    getattr(bench, name.lower())()
                    print("\n\n".join(bench.sections[before:]), flush=True)
            if "PG" in only:
                print("\nPG ...", flush=True)
                with PostgresServer(fsync=True) as postgres:  # on the load CPU, as this process is
                    measure_pg.measure(bench, postgres)
                print(bench.sections[-1], flush=True)
            if "M9" in only:  # its own servers and gateways, started and stopped per policy
                print("\nM9 ...", flush=True)
                sections, goal_rows, notes = m9_routing.measure(procs, work, m9_routing.Settings())
                bench.sections += sections + notes
                for goal in goal_rows:
                    bench.goal(*goal)
                print("\n\n".join(sections + notes), flush=True)
        except LoadError as exc:
            print(f"bench failed: {exc}", file=sys.stderr)
            return 1
    minutes = (datetime.datetime.now(datetime.timezone.utc) - started).total_seconds() / 60
    text = render(bench, started, gw_cpus, load_cpus, minutes)
    out = Path(args.out) if full else Path(args.out) / "partial"
    out.mkdir(parents=True, exist_ok=True)
    target = out / (f"{started:%Y-%m-%d-%H%M}.md" if full else f"{started:%Y-%m-%d-%H%M}-{'-'.join(sorted(only))}.md")
    target.write_text(text)
    print(f"\n{bench.summary()}\n\nwritten to {target} ({minutes:.1f} min)")
    shutil.rmtree(work, ignore_errors=True)
    return 0


def render(bench: "Bench", started, gw_cpus, load_cpus, minutes: float) -> str:
    pinning = (f"gateway / pass-through pinned to CPU {min(gw_cpus)}; wrk, clients and upstreams on CPU "
               f"{min(load_cpus)}") if gw_cpus else "one CPU: nothing pinned"
    pinning += f"; all at nice {bench.args.nice}"
    pinning += f"; load average at the end {' '.join(open('/proc/loadavg').read().split()[:3])}"
    pinning += "; peers: " + (", ".join(f"{n} {peers.version(n)}" for n in bench.peers) or "none")
    return "\n\n".join([
        f"# kilnproxy bench, {started:%Y-%m-%d %H:%M} UTC",
        machine() + f"\n- {pinning}\n- `make bench` ({bench.args.rounds} rounds, {bench.args.seconds:g} s per "
        f"wrk run, {minutes:.1f} min in all); figures are medians over rounds with (min–max)",
        bench.summary(),
        *bench.sections,
    ]) + "\n"


if __name__ == "__main__":
    sys.exit(main())
