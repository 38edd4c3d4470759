"""Graceful shutdown of a gateway process: SIGTERM, the grace period, a second signal."""

import asyncio
import signal
import socket

import aiohttp
import orjson
import pytest
from processes import GatewayProcess, gateway_config

from kilnproxy.mock_servers.mock_upstream import STATS
from kilnproxy.testing import KEY, MODEL
from kilnproxy.web.server import hold_off_new_connections, start_mock

AUTH = {"Authorization": f"Bearer {KEY}"}
GEN = "X-Neocloud-Generation-Id"


@pytest.fixture
async def mock():
    running = await start_mock()
    yield running
    await running.stop()


async def open_streams(s: aiohttp.ClientSession, url: str, n: int, words: int, delay: float):
    responses = await asyncio.gather(*(s.post(f"{url}/v1/completions", headers=AUTH, json={
        "model": MODEL, "prompt": "hi", "max_tokens": words, "stream": True, "mock": {"delay": delay}})
        for _ in range(n)))
    heads = await asyncio.gather(*(r.content.readline() for r in responses))
    assert all(h.startswith(b"data: ") for h in heads)
    return responses, heads


async def finish(responses, heads) -> list[bytes]:
    bodies = [h + await r.read() for r, h in zip(responses, heads)]
    for r in responses:
        r.release()
    return bodies


async def test_sigterm_during_load_loses_no_row_and_exits_0(tmp_path, mock):
    gw = await GatewayProcess(tmp_path, gateway_config([f"{mock.url}/v1"], server={
        "shutdown_grace_seconds": 30})).start()
    seen: list[str] = []
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            responses, heads = await open_streams(s, gw.url, 20, words=10, delay=0.2)
            seen += [r.headers[GEN] for r in responses]
            stop_load, loaded = asyncio.Event(), asyncio.Event()

            async def load() -> None:
                while not stop_load.is_set():
                    try:
                        async with s.post(f"{gw.url}/v1/completions", headers=AUTH,
                                          json={"model": MODEL, "prompt": "hi", "max_tokens": 2}) as r:
                            assert r.status == 200
                            await r.read()
                            seen.append(r.headers[GEN])
                    except aiohttp.ClientConnectionError:
                        return  # the gateway stopped accepting
                    if len(seen) >= 20 + 20:
                        loaded.set()

            loaders = [asyncio.create_task(load()) for _ in range(4)]
            await loaded.wait()  # some load has gone through; it goes on during the shutdown
            gw.send(signal.SIGTERM)
            await gw.wait_for("stderr", "shutting down: waiting up to 30 s for")
            async with aiohttp.ClientSession() as fresh:
                with pytest.raises(aiohttp.ClientConnectorError):
                    await fresh.get(f"{gw.url}/healthz")
            bodies = await finish(responses, heads)
            stop_load.set()
            await asyncio.gather(*loaders)
        assert await gw.wait(timeout=30) == 0
        for body in bodies:  # streams in flight finished normally
            assert body.endswith(b"data: [DONE]\n\n") and b'"error"' not in body
            assert body.count(b"data: ") == 10 + 2
        rows = gw.rows()
        assert sorted(r["id"] for r in rows) == sorted(seen)
        assert all(r["status"] == 200 and r["error_code"] is None for r in rows)
        assert len(gw.access_log()) == len(rows)
    finally:
        await gw.stop()


def assert_ended_by_shutdown(body: bytes) -> None:
    *events, last = [e for e in body.split(b"\n\n") if e]
    assert last == b"data: [DONE]"
    assert orjson.loads(events[-1][6:]) == {"error": {
        "message": "The gateway is shutting down; retry the request.", "type": "upstream_error",
        "param": None, "code": "shutting_down"}}
    assert all(b'"error"' not in e for e in events[:-1])


async def test_streams_open_after_the_grace_period_end_with_an_error_event(tmp_path, mock):
    gw = await GatewayProcess(tmp_path, gateway_config([f"{mock.url}/v1"], server={
        "shutdown_grace_seconds": 0.5})).start()
    try:
        async with aiohttp.ClientSession() as s:
            responses, heads = await open_streams(s, gw.url, 5, words=200, delay=0.2)
            gw.send(signal.SIGTERM)
            bodies = await finish(responses, heads)
        assert await gw.wait(timeout=30) == 0
        for body in bodies:
            assert_ended_by_shutdown(body)
        rows = gw.rows()
        assert len(rows) == 5
        assert all((r["status"], r["error_code"], r["disconnected"]) == (200, "shutting_down", 0) for r in rows)
        assert all(0 < r["completion_tokens"] < 200 for r in rows)
        assert mock.app[STATS]["hangups"] == 5  # the upstream requests were closed, not left generating
        await gw.wait_for("stderr", "ending 5 stream(s) still open after 0.5 s")
    finally:
        await gw.stop()


async def test_a_second_signal_stops_waiting(tmp_path, mock):
    gw = await GatewayProcess(tmp_path, gateway_config([f"{mock.url}/v1"], server={
        "shutdown_grace_seconds": 600})).start()
    try:
        async with aiohttp.ClientSession() as s:
            responses, heads = await open_streams(s, gw.url, 3, words=200, delay=0.2)
            gw.send(signal.SIGINT)
            await gw.wait_for("stderr", "waiting up to 600 s for 3 request(s)")
            gw.send(signal.SIGTERM)
            bodies = await finish(responses, heads)
        assert await gw.wait(timeout=30) == 0
        for body in bodies:
            assert_ended_by_shutdown(body)
        assert len(gw.rows()) == 3
        await gw.wait_for("stderr", "ending 3 stream(s) still open")
    finally:
        await gw.stop()


async def test_requests_still_waiting_for_an_upstream_when_the_grace_period_ends_get_503(tmp_path, mock, eventually):
    """One request waits for a head that never comes, two wait in the queue of a one-slot upstream whose
    slot a long stream holds: when the grace period ends, the stream ends with its event and the three get
    503 ``shutting_down`` at once; the slot the stream frees goes to nobody."""
    reached, done = asyncio.Event(), asyncio.Event()

    async def never_answers(reader, writer):
        await reader.read(65536)
        reached.set()
        await done.wait()  # no answer, until the test is over
        writer.close()
    hanging = await asyncio.start_server(never_answers, "127.0.0.1", 0)
    hang_url = f"http://127.0.0.1:{hanging.sockets[0].getsockname()[1]}/v1"
    models = [{"id": MODEL, "upstreams": [{"url": f"{mock.url}/v1", "max_in_flight": 1}], "queue_timeout": 600,
               "upstream_model": MODEL}, {"id": "hang", "upstreams": [hang_url], "upstream_model": MODEL}]
    gw = await GatewayProcess(tmp_path, gateway_config([], models=models, server={
        "shutdown_grace_seconds": 0.5})).start()
    try:
        async with aiohttp.ClientSession() as s:
            holder, heads = await open_streams(s, gw.url, 1, words=200, delay=0.2)

            async def post(model: str, stream: bool) -> tuple[int, dict]:
                async with s.post(f"{gw.url}/v1/completions", headers=AUTH, json={
                        "model": model, "prompt": "hi", "max_tokens": 5, "stream": stream}) as resp:
                    return resp.status, await resp.json()
            waiting = [asyncio.create_task(post(model, stream)) for model, stream in
                       (("hang", False), (MODEL, True), (MODEL, False))]
            await reached.wait()

            async def queued() -> bool:
                async with s.get(f"{gw.url}/metrics") as resp:
                    return f'kilnproxy_upstream_queued_requests{{upstream="{mock.url}/v1"}} 2.0' in await resp.text()
            await eventually(queued)
            gw.send(signal.SIGTERM)
            answers = await asyncio.gather(*waiting)
            [body] = await finish(holder, heads)
        assert await gw.wait(timeout=30) == 0
        assert answers == [(503, {"error": {"message": "The gateway is shutting down; retry the request.",
                                            "type": "service_unavailable", "param": None, "code": "shutting_down"}})] * 3
        assert_ended_by_shutdown(body)
        rows = sorted((r["model"], r["status"], r["error_code"], r["disconnected"]) for r in gw.rows())
        assert rows == sorted([(MODEL, 200, "shutting_down", 0), ("hang", 503, "shutting_down", 0)]
                              + [(MODEL, 503, "shutting_down", 0)] * 2)
        assert mock.app[STATS]["requests"] == 1  # the queued requests never reached the upstream
    finally:
        await gw.stop()
        done.set()
        hanging.close()
        await hanging.wait_closed()


async def test_a_connection_kept_idle_through_the_drain_is_still_served_once_nothing_listens(tmp_path, mock):
    """A balancer may keep an idle connection through the whole drain and send a request on it just
    as the listener closes: that request is answered (closing the connection after it), not cut."""
    gw = await GatewayProcess(tmp_path, gateway_config([f"{mock.url}/v1"], server={"drain_seconds": 0.2})).start()
    body = orjson.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2})
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
    port = int(gw.url.rsplit(":", 1)[1])
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request)
        first = await reader.readuntil(b"\r\n\r\n")
        assert first.startswith(b"HTTP/1.1 200 ") and b"Connection: close" not in first
        await reader.readexactly(int(first.split(b"Content-Length: ")[1].split(b"\r\n")[0]))

        gw.send(signal.SIGTERM)  # the connection stays idle through the whole drain
        await gw.wait_for("stderr", "stopped listening; connections still open are served")
        with pytest.raises(OSError):
            await asyncio.open_connection("127.0.0.1", port)
        writer.write(request)
        second = await reader.readuntil(b"\r\n\r\n")
        assert second.startswith(b"HTTP/1.1 200 ") and b"\r\nConnection: close\r\n" in second
        answer = await reader.read()  # to the close: the gateway ends the connection after it
        assert orjson.loads(answer)["object"] == "text_completion"
        writer.close()
        assert await gw.wait(timeout=30) == 0
        assert [r["status"] for r in gw.rows()] == [200, 200]
    finally:
        await gw.stop()


async def test_a_connection_still_in_the_listeners_queue_is_served_when_the_listener_closes():
    """A connection the kernel has completed but the server has not taken yet (a balancer's new one, its
    request already sent, as the drain ends) is served when the listener closes: not reset."""
    running = await start_mock()
    client = socket.create_connection(("127.0.0.1", running.port))  # the loop has not run since: queued
    try:
        client.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        await running.stop_listening()
        await running.linger(5.0, asyncio.Event())
        client.setblocking(False)
        loop = asyncio.get_running_loop()
        answer = b""
        while chunk := await loop.sock_recv(client, 65536):
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 200 ")
    finally:
        client.close()
        await running.stop()



def test_a_listener_being_closed_holds_new_connections_off_and_keeps_those_made():
    """Before the gateway closes a listener, new connections' first packets go unanswered (their clients
    try again about a second later, find nothing listening, and are refused: a balancer retries that
    on another server), while a connection made and one waiting in the queue go on: closing the
    listener then resets no connection whose handshake ended just before."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    made = socket.create_connection(("127.0.0.1", port))
    served, _ = listener.accept()
    waiting = socket.create_connection(("127.0.0.1", port))
    waiting.sendall(b"POST")
    late = socket.socket()
    try:
        assert hold_off_new_connections(listener)
        made.sendall(b"ping")
        assert served.recv(4) == b"ping"
        queued, _ = listener.accept()
        assert queued.recv(4) == b"POST"
        queued.close()
        late.settimeout(0.3)
        with pytest.raises(socket.timeout):
            late.connect(("127.0.0.1", port))
    finally:
        for s in (made, served, waiting, late, listener):
            s.close()
