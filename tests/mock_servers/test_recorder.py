"""The recording pass-through (``kilnproxy.mock_servers.recorder``) in front of the mock upstream: what a fixture holds."""

from __future__ import annotations

import base64
import binascii
import json
from urllib.parse import quote

import aiohttp
import orjson
import pytest
from closed_ports import refused_port

from kilnproxy.mock_servers.format import FORMAT, load
from kilnproxy.testing import Recorder
from kilnproxy.web.server import start_mock

STREAM = {"model": "m", "prompt": "The capital of France is", "max_tokens": 3, "stream": True,
          "mock": {"split": True, "delay": 0.01}}


async def test_a_streamed_answer_is_saved_chunk_by_chunk_as_it_arrived(tmp_path):
    mock = await start_mock()
    try:
        async with Recorder(f"{mock.url}/v1", tmp_path) as rec, aiohttp.ClientSession() as http:
            async with http.post(f"{rec.url}/v1/completions", json=STREAM) as resp:
                assert resp.status == 200
                got = await resp.read()
            [path] = rec.saved  # on disk by the time the client saw the end of the body
            async with http.get(f"{rec.url}/v1/models") as resp:  # forwarded, not recorded
                assert resp.status == 200 and (await resp.json())["data"][0]["id"] == "mock"
            assert rec.saved == [path]
    finally:
        await mock.stop()
    assert path.name == "0001-completions-stream-200.json"
    doc = orjson.loads(path.read_bytes())
    assert doc["kilnproxy_fixture"] == FORMAT
    assert doc["request"] == {"method": "POST", "path": "/v1/completions", "body": STREAM}
    assert doc["source"] == mock.url
    fixture = load(path)
    assert fixture.content == got and got.endswith(b"data: [DONE]\n\n")
    frames = got.count(b"\n\n")
    assert len(fixture.chunks) > frames  # the mock cut every frame in two: both halves are kept apart
    assert any(not c.data.endswith(b"\n\n") for c in fixture.chunks)
    assert all(c.ms >= 0 for c in fixture.chunks) and fixture.headers_ms > 0
    assert fixture.headers["Content-Type"] == "text/event-stream; charset=utf-8"
    assert not {"Date", "Content-Length", "Transfer-Encoding"} & set(fixture.headers)
    assert (fixture.status, fixture.end) == (200, "eof")


async def test_named_fixture_and_a_client_that_leaves(tmp_path, eventually):
    mock = await start_mock()
    body = {"model": "m", "prompt": "p", "max_tokens": 200, "stream": True, "mock": {"delay": 0.01}}
    try:
        async with Recorder(f"{mock.url}/v1/", tmp_path) as rec, aiohttp.ClientSession() as http:
            resp = await http.post(f"{rec.url}/v1/completions", json=body,
                                   headers={"X-Kilnproxy-Fixture": "../left early"})
            got = b""
            while got.count(b"\n\n") < 3:
                got += await resp.content.readany()
            resp.close()
            await eventually(lambda: rec.saved)
            async with http.get(f"{mock.url}/mock/requests") as seen:
                assert "X-Kilnproxy-Fixture" not in (await seen.json())[0]["headers"]
    finally:
        await mock.stop()
    assert [p.name for p in rec.saved] == ["left-early.json"]
    fixture = load(rec.saved[0])
    assert fixture.end == "client_gone"
    assert fixture.content.startswith(got) and b"[DONE]" not in fixture.content


async def test_no_secret_is_written_in_any_encoding(tmp_path):
    bearer = "sk-upstream-Secret-1234567890"
    api_key = "key-in-a-header-abcdef"
    in_body = "sk-body-secret-7777777"
    from_env = "env-upstream-key-424242"
    basic_user, basic_pass = "alice", "hunter2-password"
    prompt = (f"tell {bearer} and {base64.b64encode(bearer.encode()).decode()} and {quote(from_env)} "
              f"and {binascii.hexlify(in_body.encode()).decode()} and Bearer some-other-token-x9z")
    body = {"model": "m", "prompt": prompt, "max_tokens": 2, "stream": True, "api_key": in_body,
            "nested": {"password": "p4ssw0rd-nested"}, "mock": {"echo": True}}
    mock = await start_mock()
    try:
        async with Recorder(f"{mock.url}/v1", tmp_path, secrets=(from_env,)) as rec, \
                aiohttp.ClientSession() as http:
            basic = base64.b64encode(f"{basic_user}:{basic_pass}".encode()).decode()
            headers = {"Authorization": f"Bearer {bearer}", "X-Api-Key": api_key,
                       "Proxy-Authorization": f"Basic {basic}", "Cookie": "session=cookie-value-99"}
            async with http.post(f"{rec.url}/v1/completions", json=body, headers=headers) as resp:
                got = await resp.read()
            async with http.get(f"{mock.url}/mock/requests") as seen:
                upstream_headers = (await seen.json())[0]["headers"]
    finally:
        await mock.stop()
    assert bearer.encode() in got  # the client gets what the server sent: only the file is scrubbed
    assert upstream_headers["Authorization"] == f"Bearer {bearer}"
    assert upstream_headers["Accept-Encoding"] == "identity"  # no secret can hide in a compressed body
    raw = rec.saved[0].read_bytes()
    text = json.dumps(orjson.loads(raw))  # also the JSON-escaped forms
    for secret in (bearer, api_key, in_body, from_env, basic_pass, basic, "cookie-value-99", "p4ssw0rd-nested",
                   "some-other-token-x9z"):
        for form in (secret, base64.b64encode(secret.encode()).decode(), quote(secret, safe=""),
                     binascii.hexlify(secret.encode()).decode()):
            assert form.encode() not in raw and form not in text, (secret, form)
    assert b"Authorization" not in raw and b"X-Api-Key" not in raw
    fixture = load(rec.saved[0])
    assert fixture.body["api_key"] == "[REDACTED]" and fixture.body["nested"]["password"] == "[REDACTED]"
    assert fixture.body["max_tokens"] == 2  # not a secret, though its name says "token"
    assert sum(map(len, (c.data for c in fixture.chunks))) == len(got)  # masks keep every chunk's length


async def test_an_unreachable_upstream_is_a_502(tmp_path):
    async with Recorder(f"http://127.0.0.1:{refused_port()}/v1", tmp_path) as rec, aiohttp.ClientSession() as http:
        async with http.post(f"{rec.url}/v1/completions", json={"model": "m"}) as resp:
            assert resp.status == 502 and (await resp.text()).startswith("Bad gateway: ")
    assert rec.saved == [] and list(tmp_path.iterdir()) == []


async def test_the_pytest_fixture_records_into_the_tests_folder(kilnproxy_recorder, tmp_path):
    mock = await start_mock()
    try:
        async with kilnproxy_recorder(f"{mock.url}/v1") as rec, aiohttp.ClientSession() as http:
            async with http.post(f"{rec.url}/v1/chat/completions", json={"model": "m", "messages": []}) as resp:
                assert resp.status == 200
    finally:
        await mock.stop()
    assert rec.saved == [tmp_path / "recorded" / "0001-chat-completions-json-200.json"]


async def test_an_upstream_that_breaks_mid_stream_is_recorded_as_reset(tmp_path):
    mock = await start_mock()
    body = {"model": "m", "prompt": "p", "max_tokens": 8, "stream": True, "mock": {"fail": "drop", "after": 2}}
    try:
        async with Recorder(f"{mock.url}/v1", tmp_path) as rec, aiohttp.ClientSession() as http:
            async with http.post(f"{rec.url}/v1/completions", json=body) as resp:
                with pytest.raises(aiohttp.ClientPayloadError):  # the client sees the break too
                    await resp.read()
    finally:
        await mock.stop()
    fixture = load(rec.saved[0])
    assert fixture.end == "reset" and fixture.content.count(b"\n\n") == 2


def test_prose_is_not_taken_for_a_credential():
    from kilnproxy.mock_servers.scrub import Scrubber
    prose = b"Basic understanding: the bearer of the news, Bearer Instruments, basic arithmetic."
    assert Scrubber().data(prose) == prose
    basic = base64.b64encode(b"user:pass").decode()
    assert Scrubber().data(f"Basic {basic}, Bearer tok3n-abc".encode()) == (
        b"Basic " + b"*" * len(basic) + b", Bearer " + b"*" * len("tok3n-abc"))
