"""The model server's own catalog: `[[models]] discover = true` and `serve --upstream URL` (docs/reference.md,
"Running it"), against a mock that serves named models and refuses others as vLLM does."""

import asyncio

import aiohttp
from test_cli import start, stop

from kilnproxy.fixtures.mock_upstream import OPTIONS
from kilnproxy.proxy import discovery
from kilnproxy.testing import Harness, free_port

SERVED = ("Qwen/Qwen3-8B", "llama3.2:3b")


def discovering(prefix="", alias="kiln-demo", upstreams=None):
    def configure(config):
        model = config["models"][0]
        model.update(id=prefix, discover=True, upstream_model="mock-vllm")
        if alias is not None:
            model["alias"] = alias
        if upstreams is not None:
            model["upstreams"] = upstreams
        del model["reject_chat_params"]
    return configure


async def catalog(h):
    async with h.session.get(f"{h.url}/v1/models", headers=h.headers()) as resp:
        assert resp.status == 200
        return [m["id"] for m in (await resp.json())["data"]]


async def test_the_mock_refuses_a_model_it_does_not_serve_as_vllm_does(tmp_path):
    async with Harness(tmp_path, mock_options={"served_models": SERVED}) as h:
        async with h.session.get(f"{h.mock_url}/v1/models") as resp:
            assert [m["id"] for m in (await resp.json())["data"]] == list(SERVED)
        async with h.session.post(f"{h.mock_url}/v1/completions", json={"model": "other", "prompt": "x"}) as resp:
            assert resp.status == 404
            assert await resp.json() == {"error": {"message": "The model `other` does not exist.",
                                                   "type": "NotFoundError", "param": "model", "code": 404}}


async def test_discovered_models_are_served_under_their_own_ids_and_the_alias_under_the_first(tmp_path):
    async with Harness(tmp_path, mock_options={"served_models": SERVED}, configure=discovering()) as h:
        assert await catalog(h) == ["kiln-demo", *SERVED]
        for model, sent in (("llama3.2:3b", "llama3.2:3b"), ("kiln-demo", "Qwen/Qwen3-8B"),
                            ("Qwen/Qwen3-8B", "Qwen/Qwen3-8B")):
            async with h.post("/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 2}) as resp:
                assert resp.status == 200
                answer = await resp.json()
            assert answer["model"] == model
            assert (await h.mock_requests())[-1]["body"]["model"] == sent
            assert answer["usage"]["cost"] == round((1 * 0.10 + 2 * 0.30) / 1e6, 10)
        async with h.post("/v1/completions", {"model": "mock-vllm", "prompt": "hi"}) as resp:
            assert resp.status == 404
            assert (await resp.json())["error"]["code"] == "model_not_found"
        rows = await h.rows()
        assert [(r["model"], r["status"]) for r in rows] == [
            ("llama3.2:3b", 200), ("kiln-demo", 200), ("Qwen/Qwen3-8B", 200), ("mock-vllm", 404)]


async def test_a_prefix_names_the_discovered_models(tmp_path):
    async with Harness(tmp_path, mock_options={"served_models": SERVED},
                       configure=discovering(prefix="vllm/", alias=None)) as h:
        assert await catalog(h) == ["vllm/Qwen/Qwen3-8B", "vllm/llama3.2:3b"]
        async with h.post("/v1/chat/completions", {"model": "vllm/llama3.2:3b", "max_tokens": 1,
                                                   "messages": [{"role": "user", "content": "hi"}]}) as resp:
            assert resp.status == 200
            assert (await resp.json())["model"] == "vllm/llama3.2:3b"
        assert (await h.mock_requests())[-1]["body"]["model"] == "llama3.2:3b"


async def test_a_server_without_a_list_serves_the_alias_alone_under_its_upstream_model(tmp_path):
    dead = f"http://127.0.0.1:{free_port()}/v1"

    def configure(config):
        discovering()(config)
        model = config["models"][0]
        config["models"].append({**model, "discover": False, "id": "real", "upstreams": model["upstreams"]})
        del config["models"][-1]["alias"]
        model["upstreams"] = [dead]
    async with Harness(tmp_path, configure=configure) as h:
        assert await catalog(h) == ["kiln-demo", "real"]
        async with h.post("/v1/completions", {"model": "kiln-demo", "prompt": "hi", "max_tokens": 1}) as resp:
            assert resp.status == 502  # the dead server, asked for the alias under its upstream_model
        rows = await h.rows()
        assert [(r["model"], r["status"], r["error_code"]) for r in rows] == [("kiln-demo", 502, "upstream_unreachable")]


async def test_the_list_is_read_again_and_new_models_are_served(tmp_path, monkeypatch):
    monkeypatch.setattr(discovery, "INTERVAL", 0.05)
    async with Harness(tmp_path, mock_options={"served_models": SERVED[:1]}, configure=discovering()) as h:
        assert await catalog(h) == ["kiln-demo", "Qwen/Qwen3-8B"]
        h.mock.app[OPTIONS]["served_models"] = ("new/model", *SERVED)
        for _ in range(100):
            if await catalog(h) == ["kiln-demo", "new/model", *SERVED]:
                break
            await asyncio.sleep(0.02)
        assert await catalog(h) == ["kiln-demo", "new/model", *SERVED]
        async with h.post("/v1/completions", {"model": "kiln-demo", "prompt": "hi", "max_tokens": 1}) as resp:
            assert resp.status == 200
        assert (await h.mock_requests())[-1]["body"]["model"] == "new/model"


async def test_serve_upstream_serves_the_servers_models_and_kiln_demo(tmp_path):
    mock_port, port = free_port(), free_port()
    mock, _ = await start(["mock-upstream", "--port", str(mock_port), "--served-model-name", SERVED[0],
                           "--served-model-name", SERVED[1]], tmp_path, b"mock upstream")
    try:
        proc, out = await start(["--port", str(port), "--upstream", f"http://127.0.0.1:{mock_port}/v1"],
                                tmp_path, b"-d '")
        try:
            assert f"models:  kiln-demo, {SERVED[0]}, {SERVED[1]}" in out.decode()
            async with aiohttp.ClientSession(headers={"Authorization": "Bearer sk-kiln-demo"}) as session:
                for model in ("kiln-demo", *SERVED):
                    async with session.post(f"http://127.0.0.1:{port}/v1/completions",
                                            json={"model": model, "prompt": "The capital", "max_tokens": 2}) as resp:
                        assert resp.status == 200, await resp.text()
                        assert (await resp.json())["model"] == model
        finally:
            await stop(proc)
    finally:
        await stop(mock)


def test_config_errors_name_the_key():
    import pytest

    from kilnproxy.config import parse_config
    from kilnproxy.errors import ConfigError
    base = {"id": "m", "upstreams": ["http://127.0.0.1:1/v1"]}
    for extra, message in (({"endpoints": ["chat"]}, "models[0] (m).endpoints: unknown endpoint 'chat'; choose from "
                            "completions, chat/completions, embeddings, responses, messages"),
                           ({"alias": "a"}, "models[0] (m).alias: only applies with discover = true"),
                           ({"discover": "yes"}, "models[0] (m).discover: must be true or false, got str 'yes'")):
        with pytest.raises(ConfigError) as caught:
            parse_config({"models": [{**base, **extra}]}, source="c.toml")
        assert str(caught.value).startswith(f"c.toml: {message}")
    config = parse_config({"models": [{**base, "id": "v/", "discover": True}], "orgs": [{"id": "o"}],
                           "keys": [{"key": "k", "org": "o", "models": ["v/Qwen"]}]})
    assert config.keys[0].models == ("v/Qwen",)  # an allow-list may name a discovered model
