"""Running it (docs/reference.md): `python -m kilnproxy` with no config serves a working demo; mock-upstream runs alone."""

import asyncio
import re
import shlex
import socket
import sqlite3
import sys
from pathlib import Path

import aiohttp
from commands import ROOT, start, stop

from kilnproxy.testing import free_port


async def test_demo_without_config_prints_key_and_a_curl_that_streams(tmp_path):
    port = free_port()
    proc, out = await start(["--port", str(port)], tmp_path, b"-d '")
    try:
        banner = out.decode()
        assert "dev key: sk-kiln-demo" in banner
        curl = re.search(r"(curl -N .*?\}')", banner, re.S).group(1).replace("\\\n", " ")
        readme = (ROOT / "README.md").read_text()
        assert curl.replace(f":{port}", ":8080").split() == \
            re.search(r"(curl -N .*?\}')", readme, re.S).group(1).replace("\\\n", " ").split()
        run = await asyncio.create_subprocess_exec(*shlex.split(curl), stdout=asyncio.subprocess.PIPE)
        body, _ = await run.communicate()
        assert run.returncode == 0
        frames = body.split(b"\n\n")
        assert frames[0].startswith(b'data: {"id":"cmpl-')
        assert b'"model":"kiln-demo"' in frames[0]
        assert body.endswith(b"data: [DONE]\n\n")
    finally:
        await stop(proc)
    rows = sqlite3.connect(tmp_path / "kilnproxy.db").execute("SELECT org, status FROM usage_events").fetchall()
    assert rows == [("demo", 200)]


async def test_mock_upstream_command_serves_a_vllm_like_api(tmp_path):
    port = free_port()
    proc, out = await start(["mock-upstream", "--port", str(port)], tmp_path, b"mock upstream")
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{port}/v1/models") as resp:
                assert resp.status == 200
            body = {"model": "m", "prompt": "hi", "max_tokens": 2, "stream": True,
                    "stream_options": {"include_usage": True}}
            async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as resp:
                raw = await resp.read()
            assert raw.count(b"data: ") == 5 and raw.endswith(b"data: [DONE]\n\n")
            async with session.post(f"http://127.0.0.1:{port}/v1/completions",
                                    json={"model": "m", "prompt": "hi", "stream_options": {}}) as resp:
                assert resp.status == 400
                assert (await resp.json())["error"]["message"] == \
                    "Stream options can only be defined when `stream=True`."
    finally:
        await stop(proc)


async def test_port_in_use_is_one_line(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kilnproxy", "--port", str(port), cwd=tmp_path,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 2
    assert err.decode().strip().startswith(f"kilnproxy: error: cannot listen on 127.0.0.1:{port}")
    assert "Traceback" not in err.decode()


async def test_pip_install_gives_a_kilnproxy_command(tmp_path):
    """The ``kilnproxy`` console script of the installed package runs the same CLI as ``python -m``."""
    from importlib.metadata import entry_points

    (script,) = entry_points(group="console_scripts", name="kilnproxy")
    assert script.value == "kilnproxy.cli.main:main"
    command = Path(sys.executable).parent / "kilnproxy"
    proc = await asyncio.create_subprocess_exec(
        str(command), "check-config", str(ROOT / "config.example.toml"), cwd=tmp_path,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    assert "qwen3-32b" in out.decode()
    proc = await asyncio.create_subprocess_exec(str(command), "--help", stdout=asyncio.subprocess.PIPE)
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert out.decode().startswith("usage: kilnproxy ")
