"""plugins/webhook.py through a real gateway and the openai SDK, POSTing to a real receiver."""

from pathlib import Path

import pytest
from aiohttp import web

from kilnproxy import KilnError
from kilnproxy.web.server import start_app

PLUGIN = Path(__file__).resolve().parents[2] / "plugins" / "webhook.py"


@pytest.fixture
async def receiver():
    """A real HTTP server that keeps what is POSTed to /usage; /broken answers 500."""
    received = []

    async def usage(request):
        received.append((dict(request.headers), await request.json()))
        return web.Response(status=204)

    async def broken(request):
        await request.read()
        return web.Response(status=500)

    app = web.Application()
    app.router.add_post("/usage", usage)
    app.router.add_post("/broken", broken)
    running = await start_app(app, "127.0.0.1", 0)
    running.received = received
    yield running
    await running.stop()


async def test_each_usage_event_is_posted(kilnproxy_harness, receiver):
    settings = {"webhook": {"url": f"{receiver.url}/usage", "headers": {"Authorization": "Bearer hook-secret"}}}
    async with kilnproxy_harness(plugins=[PLUGIN], settings=settings) as h:
        client = h.openai()
        await client.completions.create(model=h.model, prompt="Hi", max_tokens=2)
        stream = await client.completions.create(model=h.model, prompt="Hi", max_tokens=3, stream=True)
        [c async for c in stream]
        await h.usage_recorded()
        rows = await h.rows()
        assert [body for _, body in receiver.received] == rows
        assert all(headers["Authorization"] == "Bearer hook-secret" for headers, _ in receiver.received)


async def test_a_failing_receiver_is_logged_and_harmless(kilnproxy_harness, receiver, caplog):
    settings = {"webhook": {"url": f"{receiver.url}/broken"}}
    async with kilnproxy_harness(plugins=[PLUGIN], settings=settings) as h:
        out = await h.openai().completions.create(model=h.model, prompt="Hi", max_tokens=2)
        assert out.choices[0].text == " Paris is"
        await h.usage_recorded()
        [row] = await h.rows()
    assert f"webhook {receiver.url}/broken answered HTTP 500 for usage event {row['id']}" in caplog.text


async def test_url_is_required(kilnproxy_harness):
    with pytest.raises(KilnError, match=r"plugin 'webhook': startup failed: ValueError: "
                                        r"\[plugins.settings.webhook\] url is required"):
        async with kilnproxy_harness(plugins=[PLUGIN], settings={"webhook": {"timeout": 3}}):
            pass
