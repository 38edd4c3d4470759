"""``python -m kilnproxy record``, ``mock-upstream --replay`` and ``replay --against``, as processes."""

from __future__ import annotations

import re

import aiohttp
import orjson
from processes import Process

from kilnproxy.testing import free_port
from kilnproxy.web.server import start_mock

BODY = {"model": "m", "prompt": "The capital of France is", "max_tokens": 3, "stream": True,
        "stream_options": {"include_usage": True}}


async def started(process: Process, banner: str) -> str:
    await process.start()
    line = (await process.wait_for("stdout", banner))[0]
    return re.search(r"on (http://\S+?)(/v1)? ", line + " ").group(1)


async def test_record_then_replay_gives_the_same_bytes(tmp_path):
    mock = await start_mock(flavor="llamacpp")
    out = tmp_path / "recorded"
    recorder = Process(["record", "--upstream", f"{mock.url}/v1", "--out", str(out), "--port", str(free_port())],
                       tmp_path)
    replayer = Process(["mock-upstream", "--replay", str(out), "--port", str(free_port())], tmp_path)
    try:
        url = await started(recorder, "recording")
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{url}/v1/completions", json=BODY) as resp:
                live = await resp.read()
            [saved] = out.iterdir()  # written before the response ended
            big = {**BODY, "mock": {"pad_bytes": 4_000_000}}  # a file that takes a while to write
            async with http.post(f"{url}/v1/completions", json=big, headers={"X-Kilnproxy-Fixture": "big"}) as resp:
                assert len(await resp.read()) > 4_000_000
            assert (out / "big.json").exists()
            (out / "big.json").unlink()
            url = await started(replayer, "replaying 1 fixture(s)")
            async with http.post(f"{url}/v1/completions", json=BODY) as resp:
                assert (resp.status, resp.headers["Content-Type"]) == (200, "text/event-stream; charset=utf-8")
                assert await resp.read() == live
            async with http.post(f"{url}/v1/completions", json={**BODY, "model": "gpt-5"}) as resp:
                assert resp.status == 404 and "`gpt-5`" in (await resp.json())["error"]["message"]
    finally:
        await recorder.stop()
        await replayer.stop()
        await mock.stop()
    assert saved.name == "0001-completions-stream-200.json"


async def test_bad_arguments_are_one_line_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    for args, message in [
        (["record", "--upstream", "http://x/v1", "--out", "o", "--secret-env", "KILNPROXY_NO_SUCH_VAR"],
         "kilnproxy: error: --secret-env KILNPROXY_NO_SUCH_VAR: that variable is not set"),
        (["mock-upstream", "--replay", "empty"], "kilnproxy: error: --replay empty: no *.json fixture in that folder"),
        (["mock-upstream", "--replay", "nowhere"], "kilnproxy: error: nowhere: no such fixture file or folder"),
        (["mock-upstream", "--timing"], "kilnproxy: error: --timing only applies with --replay DIR"),
        (["replay", "nowhere.json", "--against", "http://127.0.0.1:1/v1"],
         "kilnproxy: error: nowhere.json: cannot read"),
    ]:
        process = Process(args, tmp_path)
        await process.start()
        assert await process.wait() == 2
        assert len(process.lines["stderr"]) == 1 and process.lines["stderr"][0].startswith(message), process.lines


async def test_replay_against_shows_what_differs_in_shape(tmp_path):
    from kilnproxy.testing import Recorder
    llama, vllm, llama2 = (await start_mock(flavor="llamacpp"), await start_mock(flavor="vllm"),
                           await start_mock(flavor="llamacpp", delay=0.001))
    try:
        async with Recorder(f"{llama.url}/v1", tmp_path) as rec, aiohttp.ClientSession() as http:
            async with http.post(f"{rec.url}/v1/completions", json=BODY) as resp:
                await resp.read()
        [fixture] = rec.saved
        outputs = {}
        for name, upstream in (("vllm", vllm), ("llama", llama2)):
            process = Process(["replay", str(fixture), "--against", f"{upstream.url}/v1", "--model", "other"],
                              tmp_path)
            await process.start()
            outputs[name] = (await process.wait(), process.lines["stdout"])
    finally:
        for m in (llama, vllm, llama2):
            await m.stop()
    code, lines = outputs["llama"]
    assert code == 0 and lines == [f"{fixture}: 0 difference(s) in shape against {llama2.url}/v1"], lines
    code, lines = outputs["vllm"]
    assert code == 1
    assert "usage: 'in the last choice chunk' -> 'a separate choices: [] chunk'" in lines
    assert "field only in the recording: timings.predicted_n: number" in lines
    assert "finish reasons: ['length'] -> ['length']" not in lines
    assert lines[-1] == f"{fixture}: {len(lines) - 1} difference(s) in shape against {vllm.url}/v1"
    assert orjson.loads(fixture.read_bytes())["request"]["body"] == BODY


async def test_replay_against_compares_only_what_a_leaving_client_read(tmp_path, eventually):
    from kilnproxy.testing import Recorder
    mock = await start_mock(flavor="llamacpp")
    body = {**BODY, "max_tokens": 200, "mock": {"delay": 0.01}}
    try:
        async with Recorder(f"{mock.url}/v1", tmp_path) as rec, aiohttp.ClientSession() as http:
            resp = await http.post(f"{rec.url}/v1/completions", json=body)
            got = b""
            while got.count(b"\n\n") < 3:
                got += await resp.content.readany()
            resp.close()
            await eventually(lambda: rec.saved)
        process = Process(["replay", str(rec.saved[0]), "--against", f"{mock.url}/v1"], tmp_path)
        await process.start()
        code = await process.wait()
    finally:
        await mock.stop()
    frames = orjson.loads(rec.saved[0].read_bytes())
    n = "".join(c["text"] for c in frames["response"]["chunks"]).count("\n\n")
    assert (code, process.lines["stdout"]) == (0, [
        f"(its client left after {n} frames: those are compared)",
        f"{rec.saved[0]}: 0 difference(s) in shape against {mock.url}/v1"])
