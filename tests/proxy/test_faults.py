"""Faults around the ledger: a database that cannot be written at start-up, upstreams that hang,
drop or send garbage, and a client that stops reading (backpressure)."""

import asyncio
import ctypes
import os
import socket
import sqlite3
import sys
from pathlib import Path

import orjson
import pytest
from aiohttp import web

from kilnproxy.proxy.gateway import GATEWAY
from kilnproxy.testing import KEY, MODEL, UPSTREAM_MODEL, completion_body
from kilnproxy.web.server import start_app

GEN = "X-Neocloud-Generation-Id"
PR_CAPBSET_DROP, CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH = 24, 1, 2  # <linux/prctl.h>, <linux/capability.h>


def write_config(folder: Path, db: str = "usage.db") -> Path:
    config = folder / "gateway.toml"
    config.write_text(f'''
[server]
port = 0

[storage]
path = "{db}"

[[models]]
id = "{MODEL}"
upstreams = ["http://127.0.0.1:9/v1"]

[[orgs]]
id = "acme"
credits = 1.0

[[keys]]
key = "{KEY}"
org = "acme"

[plugins]
entry_points = false
''')
    return config


async def serve(config: Path, **kwargs) -> tuple[int, str, str]:
    """Run ``python -m kilnproxy --config FILE`` expecting it to refuse to start."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kilnproxy", "--config", str(config), stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}, **kwargs)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise AssertionError("the gateway started on a database it cannot write") from None
    return proc.returncode, out.decode(), err.decode()


def assert_one_line(err: str, *words: str) -> None:
    assert "Traceback" not in err, err
    assert err.count("\n") == 1, err
    assert err.startswith("kilnproxy: error: cannot open the usage database"), err
    for word in words:
        assert word in err, err


def _without_root_file_access() -> None:
    """In the child, before exec: drop CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH from the capability
    bounding set, so that file modes bind even a root gateway (as they bind any other user)."""
    if os.geteuid() == 0:
        libc = ctypes.CDLL(None, use_errno=True)
        for cap in (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH):
            if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


@pytest.fixture
def ro_dir(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    yield folder
    folder.chmod(0o755)


async def test_read_only_database_stops_start_up(ro_dir):
    db = ro_dir / "usage.db"
    sqlite3.connect(db).close()
    db.chmod(0o444)
    config = write_config(ro_dir)
    ro_dir.chmod(0o555)
    code, out, err = await serve(config, preexec_fn=_without_root_file_access)
    assert (code, out) == (2, "")
    assert_one_line(err, str(db), "readonly")


async def test_locked_database_stops_start_up(tmp_path):
    db = tmp_path / "usage.db"
    holder = sqlite3.connect(db, isolation_level=None)
    try:
        holder.execute("CREATE TABLE other (x)")
        holder.execute("BEGIN EXCLUSIVE")
        holder.execute("INSERT INTO other VALUES (1)")
        code, out, err = await serve(write_config(tmp_path))
    finally:
        holder.close()
    assert (code, out) == (2, "")
    assert_one_line(err, str(db), "locked")


async def test_database_path_that_is_a_folder_stops_start_up(tmp_path):
    (tmp_path / "usage.db").mkdir()
    code, out, err = await serve(write_config(tmp_path))
    assert (code, out) == (2, "")
    assert_one_line(err, "usage.db")


def body(stream=False, **extra):
    return completion_body(stream, **{"max_tokens": 6, **extra})


@pytest.mark.parametrize("stream", [False, True])
async def test_upstream_that_hangs_before_answering(harness, stream):
    async with harness(overrides={"server": {"upstream_idle_timeout": 0.2}}) as h:
        async with h.post("/v1/completions", body(stream=stream, mock={"fail": "hang"})) as resp:
            assert resp.status == 502 and resp.content_type == "text/plain"
            assert "timed out" in await resp.text()
            row = await h.row(resp.headers[GEN])
        assert (row["status"], row["error_code"], row["cost"]) == (502, "upstream_unreachable", 0)
        assert h.app[GATEWAY].admission.count("acme") == 0
        assert (await h.mock_wait(hangups=1))["hangups"] == 1


async def test_upstream_that_stalls_mid_stream(harness):
    async with harness(overrides={"server": {"upstream_idle_timeout": 0.2, "keepalive_seconds": 0.05}}) as h:
        async with h.post("/v1/completions", body(stream=True, mock={"fail": "stall", "after": 2})) as resp:
            raw = await resp.read()
            row = await h.row(resp.headers[GEN])
        frames = raw.split(b"\n\n")
        assert b": keepalive" in frames  # the client was kept alive while the upstream was silent
        assert orjson.loads(frames[-3].removeprefix(b"data: "))["error"]["code"] == "upstream_timeout"
        assert frames[-2:] == [b"data: [DONE]", b""]
        assert (row["status"], row["error_code"], row["completion_tokens"]) == (200, "upstream_timeout", 2)
        assert (await h.mock_wait(hangups=1))["hangups"] == 1


async def test_upstream_that_drops_mid_stream(gw):
    async with gw.post("/v1/completions", body(stream=True, mock={"fail": "drop", "after": 3})) as resp:
        raw = await resp.read()
        row = await gw.row(resp.headers[GEN])
    frames = raw.split(b"\n\n")
    assert orjson.loads(frames[-3].removeprefix(b"data: "))["error"]["code"] == "upstream_error"
    assert (row["status"], row["error_code"], row["completion_tokens"]) == (200, "upstream_error", 3)
    assert row["cost"] > 0


@pytest.mark.parametrize("stream", [False, True])
async def test_upstream_that_sends_garbage(gw, stream):
    async with gw.post("/v1/completions", body(stream=stream, mock={"fail": "garbage"})) as resp:
        raw = await resp.read()
        row = await gw.row(resp.headers[GEN])
    assert resp.status == 502  # an HTML page is no answer, streamed or not: nothing was sent yet
    assert resp.headers["Content-Type"].startswith("text/plain")
    if stream:
        assert raw.startswith(b"Bad gateway: ") and b"did not answer with an event stream" in raw
    else:
        assert raw.startswith(b"Bad gateway: the upstream's answer is not JSON")
    assert (row["status"], row["error_code"]) == (502, "upstream_bad_response")
    assert row["cost"] == 0


FRAME_PAD = 512 * 1024
FRAMES = 64  # 32 MiB in all


class BigStream:
    """An upstream that streams ``FRAMES`` half-MiB chunks as fast as it may write them."""

    def __init__(self):
        self.sent = 0
        self.done = asyncio.Event()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        text = b"x" * FRAME_PAD
        for i in range(FRAMES):
            await resp.write(b'data: {"id":"cmpl-1","object":"text_completion","model":"'
                             + UPSTREAM_MODEL.encode() + b'","choices":[{"index":0,"text":"' + text
                             + b'","logprobs":null,"finish_reason":null}]}\n\n')
            self.sent += 1
        await resp.write(b'data: {"id":"cmpl-1","object":"text_completion","model":"' + UPSTREAM_MODEL.encode()
                         + b'","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":64,"total_tokens":69}}'
                         b'\n\ndata: [DONE]\n\n')
        await resp.write_eof()
        self.done.set()
        return resp


async def raw_client(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A client with a small receive buffer that we can stop reading from."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    return await asyncio.open_connection(sock=sock, limit=4096)


async def test_a_client_that_stops_reading_holds_the_upstream_back(harness):
    """The gateway reads from the upstream only as fast as the client reads: while the client
    reads nothing, the upstream's writes block after a few MiB of a 32 MiB stream."""
    upstream = BigStream()
    app = web.Application()
    app.router.add_post("/v1/completions", upstream.handle)
    server = await start_app(app, "127.0.0.1", 0)
    models = [{"id": MODEL, "upstreams": [f"{server.url}/v1"], "upstream_model": UPSTREAM_MODEL,
               "pricing": {"prompt": 0.1, "completion": 0.3}}]
    try:
        async with harness(overrides={"models": models}) as h:
            reader, writer = await raw_client(h.gateway.port)
            payload = orjson.dumps(body(stream=True))
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nAuthorization: Bearer " + KEY.encode()
                         + b"\r\nContent-Type: application/json\r\nContent-Length: "
                         + str(len(payload)).encode() + b"\r\n\r\n" + payload)
            await writer.drain()
            # Read nothing; wait until the upstream can write no more.
            counts = []
            while len(counts) < 5 or len(set(counts[-5:])) > 1:
                assert not upstream.done.is_set(), "the whole stream was buffered for a client reading nothing"
                counts.append(upstream.sent)
                await asyncio.sleep(0.05)
            assert 0 < upstream.sent < FRAMES // 2
            # Now read it all: nothing was lost while the stream was held back.
            received = 0
            tail = b""
            while not tail.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"):
                chunk = await reader.read(1 << 20)
                assert chunk, "the gateway closed the stream early"
                received += len(chunk)
                tail = (tail + chunk)[-64:]
            writer.close()
            await writer.wait_closed()
            assert received > FRAMES * FRAME_PAD
            await upstream.done.wait()
            rows = await h.rows()
            assert [(r["status"], r["completion_tokens"], r["disconnected"]) for r in rows] == [(200, 64, 0)]
    finally:
        await server.stop()
