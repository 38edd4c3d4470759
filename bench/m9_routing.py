"""M9: routing a model's requests across its upstreams (SPEC 13) on multi-turn conversations.

Conversations that resend their whole growing history every turn, a pause between turns (a person
reading, an agent running a tool), each turn sent to one of 2 gateway replicas in turn (two
``python -m kilnproxy serve`` processes on one config, a SQLite file each), side by side for
``round_robin``, ``least_busy`` and ``cache_aware`` in one run, each policy on servers started afresh
(empty caches) with the same conversations:

- (a) the mock fleet: 16 mock upstreams with prompt caches in one process (``mock_fleet.py``),
  256 conversations × 8 turns, 2,000-token openings (one per conversation), a prefill time per
  token not cached;
- (b) 3 real llama.cpp servers (``make e2e``'s binary and model, ``--parallel 4``, ``--cache-ram 0``),
  9 conversations × 4 turns, ~500-token openings; skipped with one line when llama.cpp is not
  installed.

Per policy: the prompt tokens the servers computed (prompt − cached, from the usage each answer
carried: the servers' own ``prompt_tokens_details.cached_tokens``; beside it what the servers' counters
say), time to first token p50/p99 of the later turns (the 2nd on), requests per server (most / fair
share: from the usage rows' ``upstream`` column when the gateway writes it, else from the servers'
counters). Targets (issue 40): cache_aware computes ≤ 1/4 of least_busy's prompt tokens on the mock
fleet; on the real servers the later turns' TTFT p50 ≤ 0.5× least_busy's; no server above 1.5× its
fair share. On llama.cpp, where each run's placement decides the result, each policy's profile too: per
server, the conversations that have it first in cache_aware's order (the gateway's own affinity module on
the run's URLs), those whose first turn it served, the later turns it served and how many found their
conversation in its cache, and the slots its log says it took from a conversation it held (evictions).

A policy the gateway does not accept yet (its config refused at start) is reported as such.

    python bench/m9_routing.py [--only mock,llama] [--conversations 256] [--turns 8] ...

writes ``results/<date>-<time>-m9.md``; ``run.py --only M9`` (and a full ``make bench``) runs the same.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import importlib.util
import os
import random
import re
import sqlite3
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import orjson

from procs import Procs, free_port
from report import machine, table

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PY = sys.executable
KEY = "sk-bench-m9"
MODEL = "m9"
POLICIES = ("round_robin", "least_busy", "cache_aware")
LLAMA_ALIAS = "gemma3-270m"

# A vocabulary of plain English words: on Gemma's tokenizer about one token each (with its space).
WORDS = ("time year people way day man thing woman life child world school state family student group "
         "country problem hand part place case week company system program question work government number "
         "night point home water room mother area money story fact month lot right study book eye job word "
         "business issue side kind head house service friend father power hour game line end member law car "
         "city community name president team minute idea kid body information back parent face others level "
         "office door health person art war history party result change morning reason research girl guy "
         "moment air teacher force education river garden window bread stone paper music market letter field "
         "island horse winter summer forest engine doctor village ocean bridge mountain kitchen table").split()


@dataclass
class Fleet:
    """The servers of one part: what they are, how to start them, how to read their counters."""
    name: str
    conversations: int
    turns: int
    opening_words: int
    pause: tuple[float, float]  # seconds between turns, uniform in this range
    stagger: float  # conversations start spread over this many seconds
    max_tokens: int
    upstream_model: str
    extra_body: dict = field(default_factory=dict)


MOCK = Fleet("mock", 256, 8, 2000, (1.0, 2.0), 4.0, 8, "mock-8b")
LLAMA = Fleet("llama", 9, 4, 420, (2.0, 3.0), 3.0, 16, LLAMA_ALIAS, {"ignore_eos": True, "temperature": 0})


# -- conversations ---------------------------------------------------------------------------------

def opening(rng: random.Random, words: int, i: int) -> str:
    return f"Document {i}. " + " ".join(rng.choice(WORDS) for _ in range(words)) + " . Summarise the document."


def follow_up(rng: random.Random, turn: int) -> str:
    a, b = rng.choice(WORDS), rng.choice(WORDS)
    return f"Question {turn}: what does the document say about the {a} and the {b}? Answer briefly."


@dataclass
class Turn:
    conversation: int
    turn: int
    replica: int
    status: int = 0
    ttft: float | None = None
    prompt: int | None = None
    cached: int | None = None
    error: str = ""
    generation_id: str = ""


async def stream_turn(session: aiohttp.ClientSession, url: str, body: dict, rec: Turn) -> str:
    """POST one streamed chat turn; the answer's text. Sets the turn's status, TTFT and usage."""
    start = time.perf_counter()
    text = []
    try:
        async with session.post(f"{url}/v1/chat/completions", json=body,
                                headers={"Authorization": f"Bearer {KEY}"}) as resp:
            rec.status = resp.status
            rec.generation_id = resp.headers.get("X-Neocloud-Generation-Id", "")
            if resp.status != 200:
                rec.error = (await resp.text())[:300]
                return ""
            async for line in resp.content:
                if not line.startswith(b"data: {"):
                    continue
                event = orjson.loads(line[6:])
                for choice in event.get("choices") or ():
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        if rec.ttft is None:
                            rec.ttft = time.perf_counter() - start
                        text.append(piece)
                usage = event.get("usage")
                if usage:
                    rec.prompt = usage.get("prompt_tokens")
                    rec.cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        rec.error = repr(exc)
    return "".join(text)


async def converse(fleet: Fleet, gateways: list[str], seed: int, deadline: float,
                   openings: dict[int, list] | None = None) -> list[Turn]:
    """Every conversation of ``fleet``, its turns sent to the replicas in turn; bounded by ``deadline``
    (monotonic seconds): a conversation still going then stops. ``openings`` gets each conversation's
    opening messages (what cache_aware's affinity key is made of)."""
    timeout = aiohttp.ClientTimeout(total=max(30.0, deadline - time.monotonic()))
    records: list[Turn] = []
    openings = {} if openings is None else openings

    async def one(session, i: int) -> None:
        rng = random.Random(seed * 100_003 + i)
        await asyncio.sleep(fleet.stagger * i / fleet.conversations)
        messages = [{"role": "system", "content": "You are a careful reader. Answer in one short paragraph."},
                    {"role": "user", "content": opening(rng, fleet.opening_words, i)}]
        openings[i] = messages
        for t in range(fleet.turns):
            if time.monotonic() > deadline:
                return
            replica = (i + t) % len(gateways)
            rec = Turn(i, t, replica)
            records.append(rec)
            body = {"model": MODEL, "messages": messages, "max_tokens": fleet.max_tokens, "stream": True,
                    "stream_options": {"include_usage": True}, **fleet.extra_body}
            answer = await stream_turn(session, gateways[replica], body, rec)
            if rec.status != 200:
                return
            messages = [*messages, {"role": "assistant", "content": answer},
                        {"role": "user", "content": follow_up(rng, t + 1)}]
            await asyncio.sleep(rng.uniform(*fleet.pause))

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        await asyncio.gather(*(one(session, i) for i in range(fleet.conversations)))
    return records


# -- the gateways ----------------------------------------------------------------------------------

def gateway_toml(port: int, db: Path, upstreams: list[str], upstream_model: str, policy: str) -> str:
    ups = ", ".join(f'"{u}/v1"' for u in upstreams)
    # least_busy is the default: its line is left out, so the baseline runs on a gateway that predates the key
    routing_line = "" if policy == "least_busy" else f'routing = "{policy}"'
    return f"""
[server]
host = "127.0.0.1"
port = {port}

[storage]
path = "{db}"

[limits]
max_in_flight_per_org = 100000

[[models]]
id = "{MODEL}"
upstreams = [{ups}]
upstream_model = "{upstream_model}"
context_window = 32768
{routing_line}
[models.pricing]
prompt = 0.10
completion = 0.30

[[orgs]]
id = "bench"
credits = 1000000000.0

[[keys]]
key = "{KEY}"
org = "bench"

[plugins]
modules = []
entry_points = false
"""


def start_gateways(procs: Procs, work: Path, tag: str, upstreams: list[str], upstream_model: str,
                   policy: str, cpus: set[int]) -> tuple[list[str], list[Path]]:
    """Two replicas on one config (a database each); RuntimeError when the config is refused."""
    urls, dbs = [], []
    for r in range(2):
        port = free_port()
        db = work / f"m9-{tag}-{policy}-{r}.db"
        cfg = work / f"m9-{tag}-{policy}-{r}.toml"
        cfg.write_text(gateway_toml(port, db, upstreams, upstream_model, policy))
        procs.start(f"m9-{tag}-{policy}-gw{r}", [PY, "-m", "kilnproxy", "serve", "--config", str(cfg)],
                    cpus=cpus, port=port, timeout=30)
        urls.append(f"http://127.0.0.1:{port}")
        dbs.append(db)
    return urls, dbs


def upstream_of_rows(dbs: list[Path]) -> dict[str, str] | None:
    """Each row's upstream by generation id, from the replicas' usage rows; None when the rows have no ``upstream``."""
    out: dict[str, str] = {}
    for db in dbs:
        try:
            with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
                cols = [r[1] for r in conn.execute("PRAGMA table_info(usage_events)")]
                if "upstream" not in cols:
                    return None
                out.update((i, str(up)) for i, up in conn.execute("SELECT id, upstream FROM usage_events"))
        except sqlite3.Error:
            return None
    return out


def get_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read().decode()


def mock_counters(urls: list[str]) -> dict[str, dict]:
    out = {}
    for u in urls:
        s = orjson.loads(get_text(f"{u}/mock/cache"))
        out[u] = {"requests": s["requests"], "computed": s["prompt_tokens"] - s["hits"]}
    return out


def llama_metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def llama_counters(urls: list[str], max_tokens: int) -> dict[str, dict]:
    """Requests from the tokens predicted (every answer is ``max_tokens`` long: ``ignore_eos``); tokens computed
    from ``llamacpp:prompt_tokens_total`` (the tokens it evaluated, the cached ones apart)."""
    out = {}
    for u in urls:
        text = get_text(f"{u}/metrics")
        out[u] = {"requests": round(llama_metric(text, "llamacpp:tokens_predicted_total") / max_tokens),
                  "computed": int(llama_metric(text, "llamacpp:prompt_tokens_total"))}
    return out


# -- the servers -----------------------------------------------------------------------------------

def start_mock_fleet(procs: Procs, work: Path, policy: str, servers: int, slots: int, prefill: float,
                     delay: float, cpus: set[int]) -> list[str]:
    name = f"m9-fleet-{policy}"
    proc = procs.start(name, [PY, str(HERE / "mock_fleet.py"), "--servers", str(servers), "--slots", str(slots),
                              "--prefill", str(prefill), "--delay", str(delay)], cpus=cpus)
    log = work / f"{name}.log"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines():
            if line.startswith("fleet ready: "):
                return line.split()[2:]
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited: {log.read_text()[-2000:]}")
        time.sleep(0.05)
    raise RuntimeError(f"{name} not ready within 30 s")


def e2e_stack():
    """tests/e2e/stack.py (the e2e binary and model), loaded by path: bench/ is not a package of tests."""
    spec = importlib.util.spec_from_file_location("e2e_stack", ROOT / "tests" / "e2e" / "stack.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def start_llama(procs: Procs, name: str, parallel: int, threads: int, cpus: set[int]) -> str:
    stack = e2e_stack()
    port = free_port()
    argv = [str(stack.llama_binary()), "--model", str(stack.model_path()), "--alias", LLAMA_ALIAS,
            "--host", "127.0.0.1", "--port", str(port), "--ctx-size", str(parallel * 2048), "--parallel",
            str(parallel), "--threads", str(threads), "--seed", "42", "--metrics", "--slots", "--no-webui",
            "--cache-ram", "0"]
    procs.start(name, argv, cpus=cpus, port=port, timeout=120)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if urllib.request.urlopen(f"{url}/health", timeout=5).status == 200:
                return url
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{name} never became healthy")


# -- one part --------------------------------------------------------------------------------------

def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def run_part(fleet: Fleet, procs: Procs, work: Path, start_servers, counters, policies=POLICIES,
             seed: int = 9, budget: float = 600.0, slot_logs=None) -> dict[str, dict]:
    """Each policy on fresh servers: the figures, or ``{"refused": why}``. ``slot_logs(policy, urls)``, when
    given: each server's slot hand-outs as its log tells them (``slot_handouts``), read after the run."""
    cpus = set(range(os.cpu_count() or 1))
    results: dict[str, dict] = {}
    for policy in policies:
        urls = start_servers(policy)
        try:
            before = counters(urls)
            try:
                gateways, dbs = start_gateways(procs, work, fleet.name, urls, fleet.upstream_model, policy, cpus)
            except RuntimeError as exc:
                lines = [l for l in str(exc).splitlines() if l.strip()]
                results[policy] = {"refused": (lines[-1] if lines else str(exc))[:200]}
                print(f"  {fleet.name} {policy}: the gateway refused the config: {results[policy]['refused']}",
                      flush=True)
                continue
            t0 = time.monotonic()
            openings: dict[int, list] = {}
            records = asyncio.run(converse(fleet, gateways, seed, t0 + budget, openings))
            wall = time.monotonic() - t0
            time.sleep(1.0)  # the rows' commits
            after = counters(urls)
            by_rows = upstream_of_rows(dbs)
            handouts = slot_logs(policy, urls) if slot_logs is not None else None
        finally:
            for name, proc in list(procs.running):
                if name.startswith(f"m9-{fleet.name}") or name.startswith(f"m9-fleet-{policy}"):
                    procs.stop(proc)
        results[policy] = summarise(fleet, records, before, after, by_rows, urls, wall)
        results[policy]["servers"] = per_server(records, by_rows, urls, openings, handouts, policy)
        r = results[policy]
        print(f"  {fleet.name} {policy}: {r['ok']}/{r['sent']} ok, computed {r['computed']:,} of {r['prompt']:,} "
              f"prompt tokens, later TTFT p50 {r['ttft_p50']:.3f} s p99 {r['ttft_p99']:.3f} s, most requests "
              f"{r['max_share']:.2f}× fair share ({wall:.0f} s)", flush=True)
    return results


def summarise(fleet: Fleet, records: list[Turn], before, after, by_rows, urls, wall) -> dict:
    ok = [r for r in records if r.status == 200 and r.prompt is not None]
    later = [r.ttft for r in ok if r.turn > 0 and r.ttft is not None]
    first = [r.ttft for r in ok if r.turn == 0 and r.ttft is not None]
    prompt = sum(r.prompt for r in ok)
    cached = sum(r.cached or 0 for r in ok)
    later_prompt = sum(r.prompt for r in ok if r.turn > 0)
    later_cached = sum(r.cached or 0 for r in ok if r.turn > 0)
    server = {u: {k: after[u][k] - before[u][k] for k in ("requests", "computed")} for u in urls}
    home: dict[int, str] = {}  # conversation -> the server of its first turn
    stayed = later_n = 0
    if by_rows:
        counts: dict[str, int] = {}
        for up in by_rows.values():
            counts[up] = counts.get(up, 0) + 1
        per_server = [counts.get(f"{u}/v1", 0) for u in urls]
        source = "rows"
        for r in sorted(ok, key=lambda r: r.turn):
            up = by_rows.get(r.generation_id)
            if r.turn == 0:
                home[r.conversation] = up
            elif up is not None and r.conversation in home:
                later_n += 1
                stayed += up == home[r.conversation]
    else:
        per_server = [server[u]["requests"] for u in urls]
        source = "servers"
    fair = sum(per_server) / len(urls) if urls else 0
    errors = sorted({r.error or str(r.status) for r in records if r.status != 200 or r.prompt is None})
    return {"sent": len(records), "ok": len(ok), "prompt": prompt, "cached": cached,
            "computed": prompt - cached, "server_computed": sum(s["computed"] for s in server.values()),
            "later_hit": later_cached / later_prompt if later_prompt else 0.0,
            "ttft_p50": pct(later, 0.5) or 0.0, "ttft_p99": pct(later, 0.99) or 0.0,
            "first_p50": pct(first, 0.5) or 0.0, "per_server": per_server, "source": source,
            "max_share": max(per_server) / fair if fair else 0.0, "wall": wall, "errors": errors[:3],
            "stayed": f"{stayed}/{later_n}" if later_n else "-",
            "homes": " ".join(str(sum(1 for h in home.values() if h == f"{u}/v1")) for u in urls) if home else "-"}


# -- where the conversations went: the profile of each run ------------------------------------------

_LRU = re.compile(r"selected slot by LRU, t_last = (-?\d+)")
_LCP = re.compile(r"selected slot by LCP similarity, .*f_keep = ([0-9.]+)")


def slot_handouts(log: Path) -> dict[str, int]:
    """What a llama-server's log says of its slots: ``given``, the prompts it gave a slot; ``evicted``, of
    those, the ones whose slot held another prompt that it dropped (chosen as least recently used with
    ``t_last`` set, or by prefix similarity keeping less than half of what the slot held)."""
    given = evicted = 0
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return {"given": 0, "evicted": 0}
    for line in text.splitlines():
        m = _LRU.search(line)
        if m:
            given += 1
            evicted += m.group(1) != "-1"
            continue
        m = _LCP.search(line)
        if m:
            given += 1
            evicted += float(m.group(1)) < 0.5
    return {"given": given, "evicted": evicted}


def first_choices(openings: dict[int, list], urls: list[str]) -> list[int] | None:
    """How many conversations have each server first in cache_aware's order (the gateway's own affinity key
    and rendezvous order, on these URLs); None when this build has no such module."""
    try:
        from kilnproxy.proxy.upstream.affinity import Rendezvous, affinity_key
    except ImportError:
        return None
    order = Rendezvous([f"{u}/v1" for u in urls])
    out = [0] * len(urls)
    for messages in openings.values():
        out[order.order(affinity_key("chat/completions", {"messages": messages}))[0]] += 1
    return out


def per_server(records: list[Turn], by_rows, urls: list[str], openings, handouts, policy: str) -> list[dict]:
    """Each server's part in the run: the conversations whose first turn it served (``homes``, and their
    numbers), the later turns it served and how many found their conversation in its cache (cached tokens at
    least half the conversation's previous prompt: the servers' own figure), and what its log says of its
    slots. ``first``: cache_aware's placement by the hash alone (conversations that have it first)."""
    shown = [f"{u}/v1" for u in urls]
    out = [{"url": u, "homes": [], "turns": 0, "later": 0, "found": 0, "given": None, "evicted": None,
            "first": None} for u in urls]
    if policy == "cache_aware":
        first = first_choices(openings, urls)
        for s, n in zip(out, first or ()):
            s["first"] = n
    if handouts is not None:
        for s, h in zip(out, handouts):
            s.update(h)
    if not by_rows:
        return out
    previous: dict[int, int] = {}
    for r in sorted((r for r in records if r.status == 200 and r.prompt is not None), key=lambda r: r.turn):
        up = by_rows.get(r.generation_id)
        if up not in shown:
            continue
        s = out[shown.index(up)]
        s["turns"] += 1
        if r.turn == 0:
            s["homes"].append(r.conversation)
        elif r.conversation in previous:
            s["later"] += 1
            s["found"] += (r.cached or 0) >= previous[r.conversation] / 2
        previous[r.conversation] = r.prompt
    return out


def placement_table(results: dict[str, dict], slots: int | None) -> str:
    """Per policy and server: where the conversations went and what the servers' caches did with them."""
    rows = []
    for policy in POLICIES:
        r = results.get(policy)
        if not r or "servers" not in r:
            continue
        for i, s in enumerate(r["servers"]):
            homes = s["homes"]
            over = f" (**{len(homes)} > {slots} slots**)" if slots and len(homes) > slots else ""
            rows.append([policy if i == 0 else "", f"{i} (:{s['url'].rsplit(':', 1)[1]})",
                         "-" if s["first"] is None else str(s["first"]),
                         f"{len(homes)}{over}: " + (", ".join(f"c{c}" for c in sorted(homes)) or "none"),
                         str(s["turns"]), f"{s['found']} of {s['later']}",
                         "-" if s["given"] is None else f"{s['evicted']} of {s['given']}"])
    return table(["policy", "server", "conversations that have it first in cache_aware's order",
                  "conversations whose first turn it served", "turns it served",
                  "later turns it served that found their conversation in its cache",
                  "prompts given a slot that held another conversation (its log) of all it gave a slot"], rows)


def placement_verdict(results: dict[str, dict], slots: int) -> str:
    """One sentence per policy: the most conversations a server held against its slots, the evictions."""
    out = []
    for policy in POLICIES:
        r = results.get(policy)
        if not r or "servers" not in r:
            continue
        servers = r["servers"]
        homes = [len(s["homes"]) for s in servers]
        found = sum(s["found"] for s in servers)
        later = sum(s["later"] for s in servers)
        evicted = [s["evicted"] for s in servers if s["evicted"] is not None]
        line = (f"{policy}: first turns {'/'.join(map(str, homes))} on the servers"
                + (f" (the hash alone: {'/'.join(str(s['first']) for s in servers)})"
                   if servers and servers[0]["first"] is not None else "")
                + f"; {found} of {later} later turns found their conversation where they landed"
                + (f"; the servers gave {sum(evicted)} slots away from a conversation they held" if evicted else ""))
        full = [i for i, n in enumerate(homes) if n > slots]
        if full:
            line += (f"; server {', '.join(map(str, full))} held more conversations than its {slots} slots, so "
                     "each turn there evicts another conversation, which its next turn finds gone")
        out.append(line + ".")
    return "\n".join(f"- {line}" for line in out)


# -- the report ------------------------------------------------------------------------------------

def section(fleet: Fleet, title: str, results: dict[str, dict], note: str) -> str:
    rows = []
    base = results.get("least_busy", {})
    for policy in POLICIES:
        r = results.get(policy)
        if r is None:
            continue
        if "refused" in r:
            rows.append([policy, "not accepted by this build: " + r["refused"].replace("|", "/")] + [""] * 9)
            continue
        share = (f"{r['computed'] / base['computed']:.2f}×" if base.get("computed") and policy != "least_busy"
                 else "1" if policy == "least_busy" else "-")
        ttft_x = (f"{r['ttft_p50'] / base['ttft_p50']:.2f}×" if base.get("ttft_p50") and policy != "least_busy"
                  else "1" if policy == "least_busy" else "-")
        rows.append([policy, f"{r['ok']}/{r['sent']}", f"{r['computed']:,} of {r['prompt']:,} ({share})",
                     f"{r['server_computed']:,}", f"{r['later_hit'] * 100:.0f}%",
                     f"{r['ttft_p50']:.3f} ({ttft_x}) / {r['ttft_p99']:.3f}", f"{r['first_p50']:.3f}",
                     " ".join(str(n) for n in r["per_server"]) + f" ({r['source']})", f"{r['max_share']:.2f}×",
                     r["homes"], r["stayed"]])
    errors = [f"{p}: {'; '.join(r['errors'])}" for p, r in results.items() if r.get("errors")]
    return (f"## {title}\n\n" + table(
        ["policy", "turns answered", "prompt tokens computed (prompt − cached; × least_busy)",
         "computed, the servers' counters", "later turns' prompt tokens cached", "later turns' TTFT p50 / p99 (s)",
         "first turns' TTFT p50 (s)", "requests per server", "most / fair share",
         "conversations per server (their first turns')", "later turns on their first turn's server"], rows)
        + f"\n\n{note}" + (("\n\nFailed turns: " + " | ".join(errors)) if errors else ""))


def goals(mock: dict | None, llama: dict | None) -> list[list[str]]:
    """[name, target, figure, met] rows."""
    out = []

    def ok(policy_results, policy):
        r = (policy_results or {}).get(policy)
        return r if r and "refused" not in r and r["ok"] else None

    ca, lb = ok(mock, "cache_aware"), ok(mock, "least_busy")
    if mock is not None:
        if ca and lb and lb["computed"]:
            f = ca["computed"] / lb["computed"]
            out.append(["M9a", "mock fleet: cache_aware's prompt tokens computed ≤ 1/4 of least_busy's",
                        f"{f:.3f}×", f <= 0.25])
        else:
            out.append(["M9a", "mock fleet: cache_aware's prompt tokens computed ≤ 1/4 of least_busy's",
                        "cache_aware or least_busy not run", None])
    ca_l, lb_l = ok(llama, "cache_aware"), ok(llama, "least_busy")
    if llama is not None:
        if ca_l and lb_l and lb_l["ttft_p50"]:
            f = ca_l["ttft_p50"] / lb_l["ttft_p50"]
            out.append(["M9b", "llama.cpp: cache_aware's later-turn TTFT p50 ≤ 0.5× least_busy's",
                        f"{f:.2f}× ({ca_l['ttft_p50']:.2f} s vs {lb_l['ttft_p50']:.2f} s)", f <= 0.5])
        else:
            out.append(["M9b", "llama.cpp: cache_aware's later-turn TTFT p50 ≤ 0.5× least_busy's",
                        "cache_aware or least_busy not run", None])
    for tag, res in (("mock fleet", mock), ("llama.cpp", llama)):
        for policy in POLICIES:
            r = ok(res, policy)
            if r:
                out.append(["M9", f"{tag}, {policy}: no server above 1.5× its fair share of requests",
                            f"{r['max_share']:.2f}×", r["max_share"] <= 1.5])
    return out


# -- entry points ----------------------------------------------------------------------------------

@dataclass
class Settings:
    parts: tuple[str, ...] = ("mock", "llama")
    mock_servers: int = 16
    mock_slots: int = 32
    prefill: float = 0.0001  # 10,000 prompt tokens/s a server: an 8B model on one GPU
    chunk_delay: float = 0.02  # 50 tokens/s a stream
    llama_parallel: int = 4
    llama_threads: int = 1
    budget: float = 600.0  # seconds a policy may run at most
    policies: tuple[str, ...] = POLICIES


def measure(procs: Procs, work: Path, settings: Settings, mock_fleet: Fleet = MOCK,
            llama_fleet: Fleet = LLAMA) -> tuple[list[str], list[list[str]], list[str]]:
    """The sections, goal rows and notes of M9."""
    sections, notes = [], []
    cpus = set(range(os.cpu_count() or 1))
    mock_res = llama_res = None
    if "mock" in settings.parts:
        print(f"M9a: {settings.mock_servers} mock servers, {mock_fleet.conversations} conversations × "
              f"{mock_fleet.turns} turns", flush=True)
        mock_res = run_part(
            mock_fleet, procs, work,
            lambda policy: start_mock_fleet(procs, work, policy, settings.mock_servers, settings.mock_slots,
                                            settings.prefill, settings.chunk_delay, cpus),
            mock_counters, policies=settings.policies, budget=settings.budget)
        sections.append(section(
            mock_fleet, f"M9a routing: {settings.mock_servers} mock servers with prompt caches, "
            f"{mock_fleet.conversations} conversations × {mock_fleet.turns} turns, 2 replicas", mock_res,
            f"Each server: {settings.mock_slots} prompt-cache slots, {settings.prefill * 1e3:g} ms of prefill per "
            f"token not cached ({1 / settings.prefill:,.0f} tokens/s), answers of {mock_fleet.max_tokens} tokens "
            f"at {settings.chunk_delay * 1e3:g} ms a token; openings of {mock_fleet.opening_words:,} words (the "
            f"mock's tokens) plus a system line, one per conversation; {mock_fleet.pause[0]:g}–"
            f"{mock_fleet.pause[1]:g} s between turns; conversations started over {mock_fleet.stagger:g} s; each "
            f"turn to the other replica. The servers restarted (caches empty) for each policy. Computed tokens "
            f"from the answers' usage (prompt_tokens − prompt_tokens_details.cached_tokens); the servers' "
            f"counters: prompt tokens − prefix-cache hits (/mock/cache)."))
    if "llama" in settings.parts:
        try:
            stack = e2e_stack()
            stack.llama_binary()
            stack.model_path()
        except Exception as exc:  # noqa: BLE001 — the part is skipped with its reason
            notes.append(f"M9b skipped: llama.cpp or the model is not installed ({exc}); `make e2e` installs them")
            print(notes[-1], flush=True)
        else:
            print(f"M9b: 3 llama.cpp servers, {llama_fleet.conversations} conversations × {llama_fleet.turns} "
                  "turns", flush=True)

            def start(policy):
                return [start_llama(procs, f"m9-llama-{policy}-{i}", settings.llama_parallel,
                                    settings.llama_threads, cpus) for i in range(3)]

            def stop_llamas(policy):
                for name, proc in list(procs.running):
                    if name.startswith(f"m9-llama-{policy}-"):
                        procs.stop(proc)

            llama_res = {}
            for policy in settings.policies:
                try:
                    llama_res.update(run_part(
                        llama_fleet, procs, work, start, lambda urls: llama_counters(urls, llama_fleet.max_tokens),
                        policies=(policy,), budget=settings.budget,
                        slot_logs=lambda policy, urls: [slot_handouts(work / f"m9-llama-{policy}-{i}.log")
                                                        for i in range(len(urls))]))
                finally:
                    stop_llamas(policy)
            sections.append(section(
                llama_fleet, f"M9b routing: 3 llama.cpp servers, {llama_fleet.conversations} conversations × "
                f"{llama_fleet.turns} turns, 2 replicas", llama_res,
                f"llama-server (Gemma 3 270M Q4_K_M, `make e2e`'s) `--parallel {settings.llama_parallel} "
                f"--cache-ram 0 --threads {settings.llama_threads}`, {settings.llama_parallel} × 2,048 tokens of "
                f"context; openings of ~{llama_fleet.opening_words} words (~500 tokens), answers of "
                f"{llama_fleet.max_tokens} tokens (`ignore_eos`), {llama_fleet.pause[0]:g}–{llama_fleet.pause[1]:g} "
                f"s between turns; the servers restarted for each policy. Computed tokens from the answers' usage "
                f"(the servers' own prompt_tokens_details.cached_tokens); the servers' counters: "
                f"llamacpp:prompt_tokens_total; requests per server from the rows' `upstream`, else "
                f"llamacpp:tokens_predicted_total / {llama_fleet.max_tokens}.")
                + "\n\n### Where the conversations went, and what the servers' slots did with them\n\n"
                + placement_verdict(llama_res, settings.llama_parallel) + "\n\n"
                + placement_table(llama_res, settings.llama_parallel) + "\n\n"
                + f"Each server has {settings.llama_parallel} slots, each holding one prompt (`--cache-ram 0`: "
                f"nothing kept once a slot is given to another prompt). A later turn \"found its conversation\" "
                f"when the server reported at least half of the conversation's previous prompt cached "
                f"(`prompt_tokens_details.cached_tokens`). The slots given away come from each server's own log "
                f"(`selected slot by LRU` with `t_last` set, or `by LCP similarity` keeping less than half of "
                f"the slot). cache_aware's order depends only on a conversation's opening and the servers' URLs "
                f"(new ports each run), so each run draws its own placement; the load bound counts requests in "
                f"flight (none between turns), not the conversations a server holds.")
    return sections, goals(mock_res, llama_res), notes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="mock,llama", help="parts: mock, llama")
    parser.add_argument("--conversations", type=int, default=MOCK.conversations, help="mock fleet's")
    parser.add_argument("--turns", type=int, default=MOCK.turns, help="mock fleet's")
    parser.add_argument("--llama-conversations", type=int, default=LLAMA.conversations)
    parser.add_argument("--llama-turns", type=int, default=LLAMA.turns)
    parser.add_argument("--prefill", type=float, default=Settings.prefill)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--out", default=str(HERE / "results"))
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    settings = Settings(parts=tuple(p.strip() for p in args.only.split(",") if p.strip()), prefill=args.prefill,
                        policies=tuple(args.policies.split(",")))
    mock = Fleet(**{**MOCK.__dict__, "conversations": args.conversations, "turns": args.turns})
    llama = Fleet(**{**LLAMA.__dict__, "conversations": args.llama_conversations, "turns": args.llama_turns})
    work = Path(tempfile.mkdtemp(prefix="kilnproxy-m9-"))
    print(f"M9: logs and databases in {work}", flush=True)
    started = datetime.datetime.now(datetime.timezone.utc)
    load_start = " ".join(open("/proc/loadavg").read().split()[:3])
    with Procs(work) as procs:
        sections, goal_rows, notes = measure(procs, work, settings, mock, llama)
    minutes = (datetime.datetime.now(datetime.timezone.utc) - started).total_seconds() / 60
    summary = "## Targets\n\n" + table(["", "target", "figure", "met"], [
        [g[0], g[1], g[2], "yes" if g[3] else "n/a" if g[3] is None else "**no**"] for g in goal_rows])
    text = "\n\n".join([
        f"# kilnproxy bench, M9 alone, {started:%Y-%m-%d %H:%M} UTC",
        machine() + f"\n- load average at the start {load_start}; nothing pinned (the servers, the gateways and "
        f"the clients share every CPU); `python bench/m9_routing.py --only {args.only}` ({minutes:.1f} min)",
        summary, *sections, *notes]) + "\n"
    print("\n" + text)
    if not args.no_write:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        target = out / f"{started:%Y-%m-%d-%H%M}-m9.md"
        target.write_text(text)
        print(f"written to {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
