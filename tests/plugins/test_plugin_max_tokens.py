"""plugins/max_tokens.py through a real gateway and the openai SDK."""

from pathlib import Path

import openai
import pytest

from kilnproxy import KilnError

PLUGIN = Path(__file__).resolve().parents[2] / "plugins" / "max_tokens.py"
SETTINGS = {"max_tokens": {"default": 3, "cap": 5, "orgs": {"globex": {"default": 1, "cap": 2}}}}


async def sent_upstream(h) -> list:
    return [r["body"] for r in await h.mock_requests()]


async def test_default_and_cap(kilnproxy_harness):
    async with kilnproxy_harness(plugins=[PLUGIN], settings=SETTINGS) as h:
        client = h.openai()
        out = await client.completions.create(model=h.model, prompt="Hi")
        assert out.choices[0].text == " Paris is the" and out.usage.completion_tokens == 3
        out = await client.completions.create(model=h.model, prompt="Hi", max_tokens=500)
        assert out.usage.completion_tokens == 5 and out.choices[0].finish_reason == "length"
        out = await client.completions.create(model=h.model, prompt="Hi", max_tokens=4)
        assert out.usage.completion_tokens == 4
        assert [b["max_tokens"] for b in await sent_upstream(h)] == [3, 5, 4]


async def test_per_org_values_and_chat_fields(kilnproxy_harness):
    async with kilnproxy_harness(plugins=[PLUGIN], settings=SETTINGS) as h:
        globex = h.openai(key="sk-test-globex")
        messages = [{"role": "user", "content": "Hi"}]
        await globex.chat.completions.create(model=h.model, messages=messages)
        await globex.chat.completions.create(model=h.model, messages=messages, max_completion_tokens=9)
        stream = await globex.chat.completions.create(model=h.model, messages=messages, max_tokens=9, stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        assert text == " Paris is"
        bodies = await sent_upstream(h)
        assert [(b.get("max_tokens"), b.get("max_completion_tokens")) for b in bodies] == [
            (1, None), (None, 2), (2, None)]


async def test_reject_over_cap(kilnproxy_harness):
    settings = {"max_tokens": {"cap": 5, "over_cap": "reject"}}
    async with kilnproxy_harness(plugins=[PLUGIN], settings=settings) as h:
        client = h.openai()
        with pytest.raises(openai.BadRequestError) as err:
            await client.completions.create(model=h.model, prompt="Hi", max_tokens=6, stream=True)
        assert err.value.status_code == 400
        assert err.value.body == {"message": "`max_tokens` is 6; org `acme` may ask for at most 5.",
                                  "type": "invalid_request_error", "param": "max_tokens",
                                  "code": "max_tokens_too_large"}
        out = await client.completions.create(model=h.model, prompt="Hi", max_tokens=5)
        assert out.usage.completion_tokens == 5
        rows = await h.rows()
        assert [(r["status"], r["error_code"]) for r in rows] == [(400, "max_tokens_too_large"), (200, None)]
        assert len(await sent_upstream(h)) == 1


@pytest.mark.parametrize("settings, problem", [
    ({"cap": 0}, r"\[plugins.settings.max_tokens\] cap must be a positive integer"),
    ({"over_cap": "truncate"}, r'over_cap must be "clamp" or "reject"'),
    ({"orgs": {"acme": {"limit": 3}}}, r"orgs.acme.limit: unknown setting"),
])
async def test_bad_settings_stop_start_up(kilnproxy_harness, settings, problem):
    with pytest.raises(KilnError, match=r"plugin 'max_tokens': startup failed: ValueError: .*" + problem):
        async with kilnproxy_harness(plugins=[PLUGIN], settings={"max_tokens": settings}):
            pass
