"""``kilnproxy orgs`` and ``kilnproxy keys`` with no config work on the demo's store, where the demo runs:
a key made there serves the running demo at once; elsewhere the command says what to do, in one line."""

import asyncio
import json
import os
import sys

import aiohttp
from commands import ROOT, start, stop

from kilnproxy.testing import free_port


async def kilnproxy(cwd, *args):
    env = {k: v for k, v in os.environ.items() if k != "KILNPROXY_CONFIG"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kilnproxy", *args, cwd=cwd, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env={**env, "PYTHONPATH": str(ROOT)})
    out, err = await proc.communicate()
    return proc.returncode, out.decode(), err.decode()


async def test_a_key_made_without_a_config_serves_the_running_demo(tmp_path):
    port = free_port()
    proc, _ = await start(["--port", str(port)], tmp_path, b"-d '")
    try:
        code, out, err = await kilnproxy(tmp_path, "orgs", "list", "--json")
        assert (code, err) == (0, "")
        assert [org["id"] for org in json.loads(out)["data"]] == ["demo"]
        code, out, err = await kilnproxy(tmp_path, "keys", "create", "--org", "demo", "--name", "laptop", "--json")
        assert (code, err) == (0, "")
        secret = json.loads(out)["key"]
        body = {"model": "kiln-demo", "prompt": "hi", "max_tokens": 2}
        async with aiohttp.ClientSession() as session:
            for _ in range(100):  # the running demo sees a new key within a second
                async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body,
                                        headers={"Authorization": f"Bearer {secret}"}) as resp:
                    if resp.status != 401:
                        break
                await asyncio.sleep(0.05)
            assert resp.status == 200
    finally:
        await stop(proc)


async def test_without_a_config_or_a_demo_store_the_command_says_what_to_do(tmp_path):
    code, out, err = await kilnproxy(tmp_path, "keys", "list")
    assert (code, out) == (2, "")
    assert err == (f"kilnproxy: error: no config given and no demo store {str(tmp_path / 'kilnproxy.db')!r} here: "
                   "run the command where the demo runs, or name a config: --config FILE (or set KILNPROXY_CONFIG)\n")
    assert not (tmp_path / "kilnproxy.db").exists()
