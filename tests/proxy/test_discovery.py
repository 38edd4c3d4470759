"""The model server's own catalog: `[[models]] discover = true` and `serve --upstream URL` (docs/reference.md,
"Running it"), against a mock that serves named models and refuses others as vLLM does."""

import asyncio

import aiohttp
from aiohttp import web
from closed_ports import refused_port
from commands import start, stop

from kilnproxy.mock_servers.mock_upstream import OPTIONS
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
    dead = f"http://127.0.0.1:{refused_port()}/v1"

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


# -- bounds on what an upstream's list can make the gateway hold ---------------------------------------


def discovery_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("model discovery")]


def counting_reads(monkeypatch):
    """Count the gateway's reads of its entries' lists: ``await more(n)`` returns after ``n`` more."""
    done = [0]
    listed = discovery.Discovery._listed

    async def counted(self, entry):
        try:
            return await listed(self, entry)
        finally:
            done[0] += 1
    monkeypatch.setattr(discovery.Discovery, "_listed", counted)

    async def more(n):
        goal = done[0] + n
        while done[0] < goal:
            await asyncio.sleep(0.01)
    return more


def over_the_limit(base):
    return f"model discovery: {base}/models: the list is over {discovery.MAX_LIST_BYTES} bytes; it is not read"


async def test_a_list_over_the_byte_limit_is_no_list_and_said_once(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(discovery, "INTERVAL", 0.02)
    more = counting_reads(monkeypatch)
    caplog.set_level("INFO", logger="kilnproxy")
    big = ("good/model", "x" * discovery.MAX_LIST_BYTES)  # an id too long to serve: the old code read it all
    async with Harness(tmp_path, mock_options={"served_models": big}, configure=discovering()) as h:
        base = h.config["models"][0]["upstreams"][0]
        assert await catalog(h) == ["kiln-demo"]  # the alias alone, as when the upstream answers no list
        await more(3)
        assert discovery_lines(caplog) == [over_the_limit(base)]
        h.mock.app[OPTIONS]["served_models"] = SERVED
        await more(2)
        assert await catalog(h) == ["kiln-demo", *SERVED]
        h.mock.app[OPTIONS]["served_models"] = big  # over again: said again, and what was found is kept
        await more(3)
        assert discovery_lines(caplog)[1:] == [
            f"model discovery: 3 model(s) served; new: {SERVED[0]!r}, {SERVED[1]!r}", over_the_limit(base)]
        assert await catalog(h) == ["kiln-demo", *SERVED]


SENT = web.AppKey("sent", list)
CUT = web.AppKey("cut", asyncio.Event)


async def endless_list(request: web.Request) -> web.StreamResponse:
    """A /models answer that never ends (chunked, no Content-Length); counts what it got out."""
    resp = web.StreamResponse(headers={"Content-Type": "application/json"})
    await resp.prepare(request)
    await resp.write(b'{"data": [')
    chunk = b'{"id": "m"}, ' * 5000
    try:
        while True:
            await resp.write(chunk)
            request.app[SENT][0] += len(chunk)
    except ConnectionError:
        request.app[CUT].set()
    return resp


async def test_an_endless_list_is_cut_at_the_byte_limit_not_at_the_timeout(tmp_path, caplog):
    caplog.set_level("INFO", logger="kilnproxy")
    app = web.Application()
    app[SENT], app[CUT] = [0], asyncio.Event()
    app.router.add_get("/v1/models", endless_list)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    base = f"http://127.0.0.1:{port}/v1"
    try:
        loop = asyncio.get_running_loop()
        started = loop.time()
        async with Harness(tmp_path, configure=discovering(upstreams=[base])) as h:
            assert loop.time() - started < discovery.TIMEOUT
            assert await catalog(h) == ["kiln-demo"]
            await asyncio.wait_for(app[CUT].wait(), 10)
            assert app[SENT][0] < 8 * discovery.MAX_LIST_BYTES  # what the sockets' buffers held, no more
        assert discovery_lines(caplog) == [over_the_limit(base)]
    finally:
        await runner.cleanup()


def cut_at(base, listed):
    return (f"model discovery: {base}/models: the list names {listed} models; only the first "
            f"{discovery.MAX_MODELS} that can be served are")


async def test_only_the_first_models_of_a_long_list_are_served_and_the_cut_is_said_once(tmp_path, caplog,
                                                                                          monkeypatch):
    monkeypatch.setattr(discovery, "INTERVAL", 0.02)
    more = counting_reads(monkeypatch)
    caplog.set_level("INFO", logger="kilnproxy")
    limit = discovery.MAX_MODELS
    many = ("bad\n",) + tuple(f"m{i:05d}" for i in range(limit + 4000))
    async with Harness(tmp_path, mock_options={"served_models": many}, configure=discovering(alias=None)) as h:
        base = h.config["models"][0]["upstreams"][0]
        assert await catalog(h) == [f"m{i:05d}" for i in range(limit)]
        async with h.post("/v1/completions", {"model": f"m{limit - 1:05d}", "prompt": "hi", "max_tokens": 1}) as resp:
            assert resp.status == 200
        async with h.post("/v1/completions", {"model": f"m{limit:05d}", "prompt": "hi", "max_tokens": 1}) as resp:
            assert resp.status == 404
        await more(3)
        lines = discovery_lines(caplog)
        assert lines[:2] == [f"model discovery: {base}/models: 1 model id(s) refused, with a control character "
                             "or longer than 256 characters: 'bad\\n'", cut_at(base, limit + 4001)]
        assert lines[2].startswith(f"model discovery: {limit} model(s) served; new: 'm00000', ")
        assert len(lines) == 3
        h.mock.app[OPTIONS]["served_models"] = many[1:limit + 1]  # fits: nothing to say
        await more(3)
        assert len(discovery_lines(caplog)) == 3
        h.mock.app[OPTIONS]["served_models"] = many[1:]  # cut again: said again
        await more(3)
        assert discovery_lines(caplog)[3:] == [cut_at(base, limit + 4000)]
        assert await catalog(h) == [f"m{i:05d}" for i in range(limit)]


async def test_two_upstreams_listing_the_same_full_list_cut_nothing(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(discovery, "INTERVAL", 0.02)
    more = counting_reads(monkeypatch)
    caplog.set_level("INFO", logger="kilnproxy")
    limit = discovery.MAX_MODELS
    full = tuple(f"m{i:05d}" for i in range(limit))

    def twice(config):
        discovering(alias=None)(config)
        config["models"][0]["upstreams"] *= 2  # replicas of one server list the same models

    async with Harness(tmp_path, mock_options={"served_models": full}, configure=twice) as h:
        base = h.config["models"][0]["upstreams"][0]
        assert await catalog(h) == list(full)
        await more(2)
        assert len(discovery_lines(caplog)) == 1  # "1000 model(s) served; new: ..."
        h.mock.app[OPTIONS]["served_models"] = ("m99999", *full)
        await more(2)
        assert discovery_lines(caplog)[1:] == [cut_at(base, limit + 1),
                                               f"model discovery: {limit} model(s) served; new: 'm99999'"]
        assert await catalog(h) == ["m99999", *full[:-1]]
