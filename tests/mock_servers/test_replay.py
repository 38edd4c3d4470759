"""The replaying upstream (``kilnproxy.mock_servers.replay_server``): matching, chunk boundaries, timing, how a body ends."""

from __future__ import annotations

import time

import aiohttp
import orjson
import pytest

from kilnproxy.mock_servers.format import Chunk, Fixture, FixtureError, load, load_all
from kilnproxy.mock_servers.replay_server import create_replay_app
from kilnproxy.testing import Replay
from kilnproxy.web.server import start_app

SSE = {"Content-Type": "text/event-stream"}


def fixture(name: str, body, chunks=(b"data: [DONE]\n\n",), path="/v1/completions", end="eof", ms=0.0,
            status=200, headers=SSE) -> Fixture:
    return Fixture(path=path, body=body, status=status, headers=dict(headers),
                   chunks=[Chunk(ms, c) for c in chunks], end=end, source=name)


@pytest.fixture
async def serve():
    running = []

    async def start(fixtures, **options):
        running.append(await start_app(create_replay_app(fixtures, **options), "127.0.0.1", 0))
        return running[-1].url

    yield start
    for r in running:
        await r.stop()


async def test_exact_body_first_then_path_model_and_stream(serve, tmp_path):
    fixtures = [
        fixture("a", {"model": "m", "prompt": "a", "stream": True}, [b"data: a\n\n"]),
        fixture("b", {"model": "m", "prompt": "b", "stream": True}, [b"data: b\n\n"]),
        fixture("c", {"model": "m", "prompt": "c"}, [b'{"c": 1}'], headers={"Content-Type": "application/json"}),
        fixture("d", {"model": "m", "messages": [], "stream": 1}, [b"data: d\n\n"], path="/v1/chat/completions"),
    ]
    url = await serve(fixtures)
    async with aiohttp.ClientSession() as http:
        async def ask(body, path="/v1/completions"):
            async with http.post(url + path, json=body) as resp:
                return resp.status, await resp.read()

        assert await ask({"model": "m", "prompt": "b", "stream": True}) == (200, b"data: b\n\n")
        assert await ask({"model": "m", "prompt": "zzz", "stream": "true"}) == (200, b"data: a\n\n")
        assert await ask({"model": "m", "prompt": "zzz", "stream": 0}) == (200, b'{"c": 1}')
        assert await ask({"model": "m", "prompt": "b", "stream": True}, "/v1/chat/completions") == (
            200, b"data: d\n\n")
        status, raw = await ask({"model": "other-7b", "prompt": "b", "stream": True})
        assert status == 404
        error = orjson.loads(raw)["error"]
        assert error["code"] == "fixture_not_found" and "`other-7b`" in error["message"]
        assert "stream true" in error["message"]
        status, raw = await ask({"model": "m"}, "/v1/embeddings")
        assert status == 404 and "/v1/embeddings" in orjson.loads(raw)["error"]["message"]
        async with http.get(f"{url}/v1/models") as resp:
            assert [m["id"] for m in (await resp.json())["data"]] == ["m"]
        async with http.get(f"{url}/mock/requests") as resp:
            assert [r["fixture"] for r in await resp.json()] == [None, None, None, None, None, None]


async def test_same_chunks_and_with_timing_the_recorded_delays(serve):
    chunks = [b'data: {"a":', b' 1}\n\n', b"data: [DONE]\n\n"]
    f = fixture("t", {"model": "m", "stream": True}, chunks, ms=50.0)
    f.headers_ms = 50.0
    url = await serve([f], timing=True)
    async with aiohttp.ClientSession() as http:
        started = time.perf_counter()
        async with http.post(f"{url}/v1/completions", json={"model": "m", "stream": True}) as resp:
            got = [c async for c in resp.content.iter_any()]
        elapsed = time.perf_counter() - started
    assert got == chunks  # 50 ms apart: each chunk is read on its own
    assert elapsed >= 0.2  # the headers' delay and three chunks' delays were waited


async def test_a_reset_is_replayed_as_a_broken_connection():
    broken = fixture("r", {"model": "m", "stream": True}, [b"data: {}\n\n"], end="reset")
    async with Replay(broken) as upstream, aiohttp.ClientSession() as http:
        async with http.post(f"{upstream.url}/v1/completions", json={"model": "m", "stream": True}) as resp:
            with pytest.raises(aiohttp.ClientPayloadError):
                await resp.read()


async def test_client_gone_keeps_the_stream_open_until_the_client_leaves(serve):
    url = await serve([fixture("g", {"model": "m", "stream": True}, [b"data: 1\n\n", b"data: 2\n\n"],
                               end="client_gone")])
    async with aiohttp.ClientSession() as http:
        resp = await http.post(f"{url}/v1/completions", json={"model": "m", "stream": True})
        got = b""
        while got != b"data: 1\n\ndata: 2\n\n":
            got += await resp.content.readany()
        async with http.get(f"{url}/mock/stats") as stats:
            assert (await stats.json())["open"] == 1
        resp.close()
        async with http.get(f"{url}/mock/wait", params={"hangups": 1}) as waited:
            assert (await waited.json())["hangups"] == 1


def test_load_refuses_other_versions_and_names_the_file(tmp_path):
    good = fixture("x", {"model": "m"}, [b"\xe2\x82", b"\xac ok"])  # a character cut in two
    good.save(tmp_path / "good.json")
    assert load(tmp_path / "good.json").content == "€ ok".encode()
    assert '"base64"' in (tmp_path / "good.json").read_text()
    (tmp_path / "v2.json").write_text('{"kilnproxy_fixture": 2}')
    with pytest.raises(FixtureError, match=r"v2\.json: not a kilnproxy fixture of format 1"):
        load(tmp_path / "v2.json")
    (tmp_path / "bad.json").write_text('{"kilnproxy_fixture": 1, "request": {}}')
    with pytest.raises(FixtureError, match="bad.json: a malformed fixture"):
        load_all(tmp_path / "bad.json")
    with pytest.raises(FixtureError, match="no such fixture"):
        load_all(tmp_path / "missing")


async def test_harness_takes_fixture_objects_and_the_sdk_matches_by_model_and_stream(harness):
    answer = {"id": "cmpl-1", "object": "text_completion", "model": "served-name", "choices": [
        {"index": 0, "text": " recorded", "finish_reason": "length"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}
    recorded = fixture("x", {"model": "served-name", "prompt": "p", "max_tokens": 1}, [orjson.dumps(answer)],
                       headers={"Content-Type": "application/json"})
    async with harness(replay=[recorded]) as h:
        out = await h.openai().completions.create(model=h.model, prompt="something else", max_tokens=2)
        [seen] = await h.mock_requests()
        assert h.client_body() == {"model": h.model, "prompt": "p", "max_tokens": 1}
    assert (out.model, out.choices[0].text, out.usage.completion_tokens) == (h.model, " recorded", 1)
    assert seen["body"]["model"] == "served-name" and seen["body"]["prompt"] == "something else"


@pytest.mark.parametrize("change, says", [
    (lambda d: d.update(kilnproxy_fixture=True), "not a kilnproxy fixture of format 1"),
    (lambda d: d["response"]["chunks"].append({"ms": 0, "text": 123}), "a chunk's text must be a string"),
    (lambda d: d["response"].update(status=0), "status must be from 100 to 599"),
    (lambda d: d["response"].update(status=99999), "status must be from 100 to 599"),
    (lambda d: d["response"]["headers"].update({"X-Evil": "a\r\nInjected: yes"}), "without CR, LF or NUL"),
])
def test_load_refuses_what_replay_could_not_send(tmp_path, change, says):
    """Refused at load with one line naming the file, not at the first request (a traceback, a 500, or a
    connection closed with no answer)."""
    doc = fixture("x", {"model": "m"}, [b"ok"]).to_json()
    change(doc)
    (tmp_path / "odd.json").write_bytes(orjson.dumps(doc))
    with pytest.raises(FixtureError, match=f"odd.json: .*{says}"):
        load(tmp_path / "odd.json")
