"""The inspector's "save as fixture": GET /ui/api/requests/{id}/fixture, then replayed through a gateway."""

from __future__ import annotations

import orjson

from kilnproxy.mock_servers.format import load

CAPTURE = {"inspector": {"capture": True}}
STREAM = {"prompt": "The capital of France is", "max_tokens": 4, "stream": True,
          "mock": {"flavor": "llamacpp", "split": True, "delay": 0.005}}


async def fetch(h, generation_id):
    async with h.session.get(f"{h.url}/ui/api/requests/{generation_id}/fixture") as resp:
        return resp.status, resp.headers.get("Content-Disposition"), await resp.read()


async def test_a_captured_stream_saved_as_fixture_replays_the_same_bytes(harness, tmp_path, monkeypatch):
    monkeypatch.setenv("KILNPROXY_TEST_UPSTREAM_KEY", "upstream-key-3141592653")

    def upstream_key(config):
        config["models"][0]["upstream_api_key_env"] = "KILNPROXY_TEST_UPSTREAM_KEY"

    body = {**STREAM, "suffix": "upstream-key-3141592653", "api_token": "tok-27182818"}
    async with harness(overrides=CAPTURE, configure=upstream_key) as h:
        async with h.post("/v1/completions", {"model": h.model, **body}) as resp:
            live = await resp.read()
            generation_id = resp.headers["X-Neocloud-Generation-Id"]
        await h.row(generation_id)
        status, disposition, raw = await fetch(h, generation_id)
        assert (status, disposition) == (200, f'attachment; filename="{generation_id}.json"')
        missing = await fetch(h, "gen-000000000000000000000000")
        assert missing[0] == 404 and orjson.loads(missing[2])["error"]["code"] == "not_found"
    assert b"3141592653" not in raw and b"27182818" not in raw
    path = tmp_path / "saved.json"
    path.write_bytes(raw)
    fixture = load(path)
    assert fixture.path == "/v1/completions" and fixture.status == 200 and fixture.end == "eof"
    assert fixture.body["model"] == "org/Test-Model-7B" and fixture.body["stream_options"] == {"include_usage": True}
    assert fixture.body["api_token"] == "[REDACTED]" and fixture.body["suffix"] == "*" * 23
    assert len(fixture.chunks) > fixture.content.count(b"\n\n")  # the mock's split frames, as read
    async with harness(replay=path) as h:
        async with h.post("/v1/completions", {"model": h.model, **body}) as resp:
            assert await resp.read() == live


async def test_a_non_streamed_answer_and_a_400(harness):
    async with harness(overrides=CAPTURE) as h:
        async with h.post("/v1/completions", {"model": h.model, "prompt": "hi", "max_tokens": 2}) as resp:
            answer = await resp.json()
            ok = resp.headers["X-Neocloud-Generation-Id"]
        async with h.post("/v1/completions", {"model": h.model, "prompt": "hi", "max_tokens": 0}) as resp:
            rejected = resp.headers["X-Neocloud-Generation-Id"]
        await h.row(ok)
        await h.row(rejected)
        saved = [await fetch(h, g) for g in (ok, rejected)]
    first = orjson.loads(saved[0][2])["response"]
    assert first["status"] == 200 and first["headers"] == {"Content-Type": "application/json"}
    assert orjson.loads(first["chunks"][0]["text"])["choices"] == answer["choices"]
    second = orjson.loads(saved[1][2])["response"]
    assert second["status"] == 400 and orjson.loads(second["chunks"][0]["text"])["error"]["code"] == 400
