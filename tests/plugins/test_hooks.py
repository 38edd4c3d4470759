"""Each hook does what kilnproxy/hookspecs.py promises, through a real gateway.

Every hook has a ``test_hook_<name>`` here (tests/plugins/test_plugin_meta.py checks it).
"""

import asyncio

import orjson
import pytest

from kilnproxy import DROP, STOP, Refusal, hookimpl

PROMPT = "The capital of France is"


def sse_events(raw: bytes) -> list:
    """The ``data:`` payloads of a raw SSE body, parsed (``[DONE]`` kept as a string)."""
    assert raw.endswith(b"data: [DONE]\n\n"), raw[-200:]
    out = []
    for frame in raw.split(b"\n\n")[:-1]:
        assert frame.startswith(b"data: "), frame
        payload = frame[len(b"data: "):]
        out.append("[DONE]" if payload == b"[DONE]" else orjson.loads(payload))
    return out


class Started:
    def __init__(self):
        self.events = []

    @hookimpl
    async def startup(self, gateway):
        self.events.append(("startup", dict(gateway.plugin_settings("Started")), gateway.session is not None))

    @hookimpl
    def shutdown(self, gateway):
        self.events.append(("shutdown", gateway.ledger.queue_depth()))


async def test_hook_startup(harness):
    plugin = Started()
    async with harness(plugins=[plugin], settings={"Started": {"level": 3}}) as h:
        assert plugin.events == [("startup", {"level": 3}, True)]
        await h.openai().completions.create(model=h.model, prompt=PROMPT, max_tokens=2)
        assert len(plugin.events) == 1


class Recorder:
    def __init__(self):
        self.seen = []

    @hookimpl
    async def record_usage(self, call, usage):
        await asyncio.sleep(0)
        self.seen.append(("usage", usage["id"]))

    @hookimpl
    def shutdown(self):
        self.seen.append(("shutdown",))


class BrokenShutdown:
    @hookimpl(tryfirst=True)
    def shutdown(self):
        raise RuntimeError("cannot close")


async def test_hook_shutdown(harness, caplog):
    plugin = Recorder()
    async with harness(plugins=[plugin, BrokenShutdown()]) as h:
        answer = await h.openai().completions.with_raw_response.create(model=h.model, prompt=PROMPT, max_tokens=2)
        gen_id = answer.headers["X-Neocloud-Generation-Id"]
    # after every queued record_usage call, even though another plugin's shutdown raised
    assert plugin.seen == [("usage", gen_id), ("shutdown",)]
    assert "plugin 'BrokenShutdown' failed in shutdown" in caplog.text


class Gatekeeper:
    """Refuses org globex (by return), and prompts with "forbidden" (by raising)."""

    @hookimpl
    async def check_request(self, call, body):
        if call.org == "globex":
            return Refusal(403, "org_blocked", "Org globex may not use this model today.")
        if "forbidden" in str(body.get("prompt")):
            raise Refusal(400, "prompt_refused", "No.", param="prompt")
        return None


class SecondOpinion:
    def __init__(self):
        self.asked = 0

    @hookimpl(trylast=True)
    def check_request(self):
        self.asked += 1


async def test_hook_check_request(harness):
    second = SecondOpinion()
    async with harness(plugins=[second, Gatekeeper()]) as h:
        async with h.post("/v1/completions", {"model": h.model, "prompt": PROMPT}, key="sk-test-globex") as resp:
            assert resp.status == 403
            assert await resp.json() == {"error": {"message": "Org globex may not use this model today.",
                                                   "type": "invalid_request_error", "param": None,
                                                   "code": "org_blocked"}}
            refused = resp.headers["X-Neocloud-Generation-Id"]
        async with h.post("/v1/completions", {"model": h.model, "prompt": "a forbidden word",
                                              "stream": True}) as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["code"] == "prompt_refused"
            assert (await resp.json())["error"]["param"] == "prompt"
        assert second.asked == 0  # the first refusal wins
        assert await h.mock_requests() == []
        row = await h.row(refused)
        assert (row["status"], row["error_code"], row["total_tokens"], row["cost"]) == (403, "org_blocked", 0, 0)
        out = await h.openai().completions.create(model=h.model, prompt=PROMPT, max_tokens=2)
        assert out.choices[0].text == " Paris is"
        assert second.asked == 1


class Rewriter:
    @hookimpl
    def rewrite_request(self, call, body):
        body["temperature"] = 0.5
        body.pop("user", None)
        body["prompt"] = body["prompt"].upper()
        call.state["rewritten"] = True


async def test_hook_rewrite_request(harness):
    async with harness(plugins=[Rewriter()]) as h:
        stream = await h.openai().completions.create(model=h.model, prompt=PROMPT, max_tokens=2, user="u1",
                                                     stream=True)
        assert [c.choices[0].text async for c in stream] == [" Paris", " is", ""]
        [seen] = await h.mock_requests()
        assert seen["body"] == {"model": "org/Test-Model-7B", "prompt": "THE CAPITAL OF FRANCE IS",
                                "max_tokens": 2, "stream": True, "temperature": 0.5,
                                "stream_options": {"include_usage": True}}


class Shouter:
    """Upper-cases completion text; STOPs after "capital"; DROPs the chunk " the"."""

    @hookimpl
    def transform_event(self, call, event):
        if not event["choices"]:
            event["usage"]["seen_by_plugin"] = True
            return None
        choice = event["choices"][0]
        text = choice["text"]
        if text == " the":
            return DROP
        choice["text"] = text.upper()
        if text == " capital":
            choice["finish_reason"] = "stop"
            return STOP
        return None


async def test_hook_transform_event(harness):
    async with harness(plugins=[Shouter()]) as h:
        body = {"model": h.model, "prompt": PROMPT, "max_tokens": 12, "stream": True,
                "stream_options": {"include_usage": True}, "mock": {"delay": 0.02}}
        async with h.post("/v1/completions", body) as resp:
            assert resp.status == 200
            raw = await resp.read()
            gen_id = resp.headers["X-Neocloud-Generation-Id"]
        events = sse_events(raw)
        assert [e["choices"][0]["text"] for e in events[:-2]] == [" PARIS", " IS", " CAPITAL"]
        assert events[2]["choices"][0]["finish_reason"] == "stop"
        assert all(e["model"] == h.model for e in events[:-1])
        usage = events[-2]
        assert usage["choices"] == [] and usage["usage"]["seen_by_plugin"] is True
        assert usage["usage"]["completion_tokens"] == 4  # generated so far, the dropped chunk included
        assert events[-1] == "[DONE]"
        assert (await h.mock_wait(hangups=1))["hangups"] == 1  # upstream closed: the model stopped generating
        row = await h.row(gen_id)
        assert (row["status"], row["error_code"], row["finish_reason"]) == (200, None, "stop")
        assert row["completion_tokens"] == 4 and row["disconnected"] == 0


class Annotator:
    @hookimpl
    async def transform_response(self, call, body):
        await asyncio.sleep(0)
        body["choices"][0]["text"] = body["choices"][0]["text"].strip()
        body["annotated_for"] = call.org
        assert body["model"] == call.model and "cost" in body["usage"]


async def test_hook_transform_response(harness):
    async with harness(plugins=[Annotator()]) as h:
        out = await h.openai().completions.create(model=h.model, prompt=PROMPT, max_tokens=3)
        assert out.choices[0].text == "Paris is the"
        assert out.model_extra["annotated_for"] == "acme"
        assert out.usage.completion_tokens == 3


class Tagger:
    @hookimpl
    def response_headers(self, call):
        return {"X-Org": call.org, "X-Served-By": call.upstream, "X-Stream": str(call.stream).lower()}


class LateTagger:
    @hookimpl(trylast=True)
    async def response_headers(self):
        return {"X-Org": "overridden"}


async def test_hook_response_headers(harness):
    async with harness(plugins=[LateTagger(), Tagger()]) as h:
        for stream in (False, True):
            async with h.post("/v1/completions", {"model": h.model, "prompt": PROMPT, "max_tokens": 2,
                                                  "stream": stream}) as resp:
                assert resp.status == 200
                await resp.read()
                assert resp.headers["X-Org"] == "overridden"
                assert resp.headers["X-Served-By"] == f"{h.mock_url}/v1"
                assert resp.headers["X-Stream"] == str(stream).lower()
                assert resp.headers["X-Neocloud-Generation-Id"].startswith("gen-")
        # the upstream's own 400 keeps them; errors the gateway makes itself do not get them
        async with h.post("/v1/completions", {"model": h.model, "prompt": PROMPT, "temperature": 7}) as resp:
            assert resp.status == 400 and resp.headers["X-Org"] == "overridden"
        async with h.post("/v1/completions", {"model": h.model, "prompt": PROMPT, "mock": {"fail": "500"}}) as resp:
            assert resp.status == 502 and "X-Org" not in resp.headers
        async with h.post("/v1/completions", {"model": "nope", "prompt": PROMPT}) as resp:
            assert resp.status == 404 and "X-Org" not in resp.headers


class UsageLog:
    def __init__(self, db):
        self.db = db
        self.rows = []

    @hookimpl
    async def record_usage(self, call, usage):
        import sqlite3
        with sqlite3.connect(self.db) as db:  # already committed when we are told
            assert db.execute("SELECT status FROM usage_events WHERE id = ?", (usage["id"],)).fetchone()
        with pytest.raises(TypeError):
            usage["cost"] = 0
        self.rows.append((call.generation_id, dict(usage)))


async def test_hook_record_usage(harness, tmp_path):
    plugin = UsageLog(tmp_path / "usage.db")
    async with harness(plugins=[plugin]) as h:
        client = h.openai()
        await client.completions.create(model=h.model, prompt=PROMPT, max_tokens=2)
        stream = await client.chat.completions.create(model=h.model, messages=[{"role": "user", "content": "hi"}],
                                                      max_tokens=3, stream=True)
        async for _ in stream:
            pass
        async with h.post("/v1/completions", {"model": h.model, "prompt": PROMPT, "mock": {"fail": "500"}}) as resp:
            assert resp.status == 502
        async with h.post("/v1/completions", {"model": "nope"}) as resp:
            assert resp.status == 404
        await h.usage_recorded()
        rows = await h.rows()
        assert [r["status"] for r in rows] == [200, 200, 502, 404]
        assert [gen for gen, _ in plugin.rows] == [r["id"] for r in rows]  # once each, in commit order
        assert {gen: u for gen, u in plugin.rows} == {r["id"]: r for r in rows}
