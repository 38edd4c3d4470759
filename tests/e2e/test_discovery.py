"""``python -m kilnproxy --upstream URL`` in front of llama.cpp: the server's own catalog, served.

The demo's gateway reads llama.cpp's ``GET /v1/models`` and serves its model
under llama.cpp's own id (the ``--alias`` the server was started with), plus
``kiln-demo`` for it; both names reach the same server, and each request gets
its usage row under the name it asked for.
"""

from __future__ import annotations

import signal

import orjson
import pytest

from kilnproxy.testing import usage_row

from .stack import LLAMA_ALIAS, GatewayProcess
from .support import GENERATION_HEADER

DEMO_KEY = "sk-kiln-demo"
DEMO_MODEL = "kiln-demo"
AUTH = {"Authorization": f"Bearer {DEMO_KEY}"}


@pytest.fixture(scope="module")
def discovered(stack, tmp_path_factory):
    """The gateway as a user starts it: no sub-command, no config, ``--upstream`` the server's /v1."""
    workdir = tmp_path_factory.mktemp("discovery")
    gateway = GatewayProcess(workdir, ["--upstream", f"{stack.llama_url}/v1", "--port", "0"],
                             name="kilnproxy-discovery")
    try:
        yield gateway, workdir
    finally:
        gateway.stop(signal.SIGINT)  # no drain: nothing is in flight


async def test_catalog_is_the_servers_own_list_plus_kiln_demo(discovered, stack, http):
    gateway, _ = discovered
    async with http.get(f"{stack.llama_url}/v1/models") as resp:
        theirs = [m["id"] for m in (await resp.json())["data"]]
    assert theirs == [LLAMA_ALIAS]  # llama.cpp lists the one model it serves, under its --alias

    async with http.get(f"{gateway.url}/v1/models", headers=AUTH) as resp:
        assert resp.status == 200
        ours = {m["id"]: m for m in (await resp.json())["data"]}
    assert set(ours) == {DEMO_MODEL, LLAMA_ALIAS}
    async with http.get(f"{gateway.url}/v1/models/{LLAMA_ALIAS}", headers=AUTH) as resp:
        assert resp.status == 200 and (await resp.json())["id"] == LLAMA_ALIAS
    assert f"models:  {DEMO_MODEL}, {LLAMA_ALIAS}" in gateway.output()  # the banner says so too


@pytest.mark.parametrize("model", [LLAMA_ALIAS, DEMO_MODEL])
async def test_both_names_are_answered_and_metered(discovered, http, model):
    gateway, workdir = discovered
    body = {"model": model, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 6,
            "temperature": 0}
    async with http.post(f"{gateway.url}/v1/chat/completions", json=body, headers=AUTH) as resp:
        assert resp.status == 200, await resp.text()
        answer = await resp.json()
        generation_id = resp.headers[GENERATION_HEADER]
    assert answer["model"] == model
    assert answer["choices"][0]["message"]["content"] is not None
    usage = answer["usage"]
    assert usage["completion_tokens"] > 0 and usage["cost"] > 0

    r = usage_row(workdir / "kilnproxy.db", generation_id)
    assert (r["org"], r["model"], r["requested_model"], r["endpoint"], r["status"], r["error_code"]) == (
        "demo", model, model, "chat/completions", 200, None)
    assert (r["prompt_tokens"], r["completion_tokens"], r["cost"]) == (
        usage["prompt_tokens"], usage["completion_tokens"], usage["cost"])

    # llama.cpp answers any name, so what it was sent is read from the inspector (the demo captures):
    # the server's own id, for kiln-demo too
    async with http.get(f"{gateway.url}/ui/api/requests/{generation_id}") as resp:
        assert resp.status == 200
        capture = (await resp.json())["capture"]
    assert orjson.loads(capture["upstream_body"])["model"] == LLAMA_ALIAS


async def test_a_name_the_server_does_not_list_is_not_served(discovered, http):
    gateway, _ = discovered
    body = {"model": "not-on-this-server", "prompt": "Hi", "max_tokens": 2}
    async with http.post(f"{gateway.url}/v1/completions", json=body, headers=AUTH) as resp:
        assert resp.status == 404
        assert (await resp.json())["error"]["code"] == "model_not_found"
