"""Plugins cannot write to ``call``: a plugin that sets or deletes one of its fields (or adds its own) fails its
hook (``plugin_error``, mid-stream too) and the row keeps the request's facts; ``record_usage`` gets a read-only
call also for a request refused before the plugins; a ``Call`` built by hand is read-only too."""

import orjson
import pytest

from kilnproxy import Call, hookimpl
from kilnproxy.config import Pricing
from kilnproxy.testing import MODEL

GEN = "X-Neocloud-Generation-Id"


class Writes:
    """A plugin whose ``hook`` does ``write(call)`` (and once only, so the next request is served)."""

    __name__ = "thief"

    def __init__(self, hook: str, write):
        self.done = False

        def impl(call, **_):
            if not self.done:
                self.done = True
                write(call)

        args = {"transform_event": lambda call, event: impl(call), "record_usage": lambda call, usage: impl(call),
                "check_request": lambda call, body: impl(call), "rewrite_request": lambda call, body: impl(call),
                "transform_response": lambda call, body: impl(call)}
        setattr(self, hook, hookimpl(specname=hook)(args.get(hook, lambda call: impl(call))))


def refused(name: str) -> str:
    return f"call.{name} is read-only: a plugin may change only what call.state holds"


def to_globex(call):
    call.org = "globex"


def for_free(call):
    call.pricing = Pricing(0.0, 0.0, 0.0)


def other_id(call):
    call.generation_id = "gen-000000000000000000000001"


def no_key(call):
    del call.key_id


def new_state(call):
    call.state = {}


def own_field(call):
    call.mine = 1


@pytest.mark.parametrize("hook, write, message", [
    ("check_request", for_free, refused("pricing")),
    ("rewrite_request", to_globex, refused("org")),
    ("response_headers", no_key, refused("key_id")),
    ("transform_response", other_id, refused("generation_id")),
    ("rewrite_request", new_state, refused("state")),
    ("check_request", own_field, "call has no attribute 'mine' to set: a plugin's own data goes in call.state"),
])
async def test_a_plugin_that_writes_to_call_fails_its_hook_and_the_row_keeps_the_requests_facts(
        harness, hook, write, message):
    async with harness(plugins=[Writes(hook, write)]) as h:
        async with h.post("/v1/completions", {"model": MODEL, "prompt": "a b c", "max_tokens": 4}) as resp:
            assert resp.status == 500
            assert await resp.json() == {"error": {
                "message": f"Plugin 'thief' raised in {hook}: AttributeError: {message}", "type": "server_error",
                "param": None, "code": "plugin_error"}}
            gen = resp.headers[GEN]
        async with h.post("/v1/completions", {"model": MODEL, "prompt": "a b c", "max_tokens": 4}) as resp:
            assert resp.status == 200  # the plugin behaves now: priced as ever
            assert (await resp.json())["usage"]["cost"] == round((3 * 0.10 + 4 * 0.30) / 1e6, 10)
        rows = await h.rows()
    assert [(r["id"] == gen, r["org"], r["key_id"], r["status"], r["error_code"]) for r in rows] == [
        (True, "acme", "acme-key", 500, "plugin_error"), (False, "acme", "acme-key", 200, None)]
    assert rows[1]["cost"] == round((3 * 0.10 + 4 * 0.30) / 1e6, 10)


async def test_a_plugin_that_writes_to_call_mid_stream_ends_it_with_its_error_and_one_row(harness):
    async with harness(plugins=[Writes("transform_event", other_id)]) as h:
        async with h.post("/v1/completions", {"model": MODEL, "prompt": "a b c", "max_tokens": 4,
                                              "stream": True}) as resp:
            assert resp.status == 200
            raw = await resp.read()
            gen = resp.headers[GEN]
        rows = await h.rows()
    assert raw == b"data: " + orjson.dumps({"error": {
        "message": f"Plugin 'thief' raised in transform_event: AttributeError: {refused('generation_id')}",
        "type": "server_error", "param": None, "code": "plugin_error"}}) + b"\n\ndata: [DONE]\n\n"
    assert [(r["id"], r["org"], r["status"], r["error_code"]) for r in rows] == [(gen, "acme", 200, "plugin_error")]


async def test_record_usage_gets_a_read_only_call_also_for_a_request_refused_before_the_plugins(harness, caplog):
    async with harness(plugins=[Writes("record_usage", to_globex)]) as h:
        async with h.post("/v1/completions", {"model": "no-such-model", "prompt": "hi"}) as resp:
            assert resp.status == 404
            gen = resp.headers[GEN]
        await h.usage_recorded()
        rows = await h.rows()
    assert [(r["id"], r["org"], r["status"]) for r in rows] == [(gen, "acme", 404)]
    failed = [r for r in caplog.records if r.getMessage() == f"plugin 'thief' failed in record_usage for {gen}"]
    assert len(failed) == 1 and str(failed[0].exc_info[1]) == refused("org")


def test_a_call_built_by_hand_is_read_only_and_has_what_it_was_given():
    call = Call("gen-1", "acme", "key-1", "completions", model="m", upstream_model="up", stream=True,
                include_usage=True, pricing=Pricing(1.0, 2.0), upstream="http://u/v1")
    assert (call.model, call.upstream_model, call.stream, call.include_usage, call.upstream, call.state) == (
        "m", "up", True, True, "http://u/v1", {})
    assert type(call) is Call
    with pytest.raises(AttributeError, match="call.model is read-only"):
        call.model = "other"
    call.state["mine"] = 1
    assert call.state == {"mine": 1}
