"""Embeddings as SDK clients send them, through a running gateway on a real port: a batch's hold (each input
bounded by the context window), inputs and options OpenAI's API refuses (a clear 400 naming the item at fault),
every form of input, and the SDK's default base64 answer.
"""

from __future__ import annotations

import array
import asyncio
from contextlib import asynccontextmanager

import openai
import pytest
from aiohttp import web
from framed_streams import PROMPT, cost

from kilnproxy.testing import MODEL


@asynccontextmanager
async def held_upstream(answer: dict):
    """An upstream that answers ``answer`` once ``release`` is set: (its URL, a queue of the bodies it got, release)."""
    entered: asyncio.Queue = asyncio.Queue()
    release = asyncio.Event()

    async def answer_it(request: web.Request) -> web.Response:
        entered.put_nowait(await request.json())
        await release.wait()
        return web.json_response(answer)
    app = web.Application()
    app.router.add_post("/v1/embeddings", answer_it)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}/v1", entered, release
    finally:
        release.set()
        await runner.cleanup()


BATCH = ["a b c d e f g h"] * 64  # 8 tokens each: 512 in all, 32 times the context window of 16
EMBEDDED = {"object": "list", "model": "org/Up-7B", "usage": {"prompt_tokens": 512, "total_tokens": 512},
            "data": [{"object": "embedding", "index": i, "embedding": [0.5]} for i in range(64)]}


async def test_a_batch_of_inputs_is_held_for_each_input_up_to_the_context_window(harness):
    """A model's context window bounds each input, not the batch: 64 inputs of 8 tokens under a window of 16 may
    cost 512 prompt tokens. While such a batch is at the upstream, its hold (each input's bound, at most the
    window: 64 x 16 tokens) leaves an org with credits for 600 tokens nothing for a second request (402), which
    a hold of one window (16 tokens) let through; the batch is then charged the upstream's count."""
    async with held_upstream(EMBEDDED) as (url, entered, release):
        def configure(config):
            config["models"][0].update(upstreams=[url], endpoints=["embeddings"], context_window=16)
            config["orgs"][0]["credits"] = 600 * PROMPT
        async with harness(configure=configure) as h:
            client = h.openai()
            batch = asyncio.create_task(client.embeddings.create(model=MODEL, input=BATCH, encoding_format="float"))
            await entered.get()
            second = asyncio.create_task(client.embeddings.create(model=MODEL, input="x", encoding_format="float"))
            reached = asyncio.create_task(entered.get())
            done, _ = await asyncio.wait({second, reached}, return_when=asyncio.FIRST_COMPLETED)
            release.set()
            assert second in done, "the second request reached the upstream"
            with pytest.raises(openai.APIStatusError) as caught:
                await second
            reached.cancel()
            assert caught.value.status_code == 402 and caught.value.body["code"] == "insufficient_credits"
            out = await batch
            assert len(out.data) == 64 and out.usage.prompt_tokens == 512
            rows = await h.rows()
    assert sorted((r["status"], r["prompt_tokens"], r["cost"]) for r in rows) == [(200, 512, cost(512, 0)),
                                                                                (402, 0, 0)]


BAD_INPUTS = [
    ("missing", None, "`input` is required: a string, a list of strings, a list of token ids, or a list of lists "
                      "of token ids."),
    ("a number", 5, "`input` must be a string, a list of strings, a list of token ids, or a list of lists of token "
                    "ids."),
    ("an empty string", "", "`input` must not be an empty string."),
    ("an empty list", [], "`input` must not be an empty list."),
    ("an empty string in a list", ["a", ""], "`input[1]` must not be an empty string."),
    ("an empty token list", [[1, 2], []], "`input[1]` must not be an empty list."),
    ("nested lists", [[["a"]]], "`input[0][0]` must be a token id (an integer from 0), not [\"a\"]."),
    ("an object in a list", [{"text": "a"}], "`input[0]` must be a string or a list of token ids."),
    ("token lists and strings mixed", [[1], "a"], "`input[1]` must be a list of token ids, as `input[0]` is."),
    ("strings and token ids mixed", ["a", 5], "`input[1]` must be a string, as `input[0]` is."),
    ("a float token", [1, 2.5], "`input[1]` must be a token id (an integer from 0), not 2.5."),
    ("a negative token", [[1], [3, -1]], "`input[1][1]` must be a token id (an integer from 0), not -1."),
    ("a boolean token", [True], "`input[0]` must be a token id (an integer from 0), not true."),
    ("a string among token ids", [[1, "2"]], "`input[0][1]` must be a token id (an integer from 0), not \"2\"."),
    ("null in a list", ["a", None], "`input[1]` must be a string, as `input[0]` is."),
]


@pytest.mark.parametrize("value, message", [(v, m) for _, v, m in BAD_INPUTS], ids=[i for i, _, _ in BAD_INPUTS])
async def test_inputs_that_are_not_embeddings_inputs_are_a_clear_400(harness, value, message):
    """OpenAI's rules for ``input``, checked by the gateway (model servers answer some with a 500, or embed an
    empty text): the SDK's BadRequestError in OpenAI's error form naming ``input``, one row, nothing upstream."""
    async with harness(configure=lambda c: c["models"][0].update(endpoints=["embeddings"])) as h:
        with pytest.raises(openai.BadRequestError) as caught:
            await h.openai().embeddings.create(model=MODEL, input=value, encoding_format="float")
        assert caught.value.status_code == 400
        assert caught.value.body == {"message": message, "type": "invalid_request_error", "param": "input",
                                     "code": "invalid_request"}
        assert await h.mock_requests() == []
        assert [(r["endpoint"], r["status"], r["error_code"], r["cost"]) for r in await h.rows()] == [
            ("embeddings", 400, "invalid_request", 0)]


GOOD_INPUTS = {"a string": ("a b", 2), "strings": (["a b", "c"], 3), "token ids": ([1, 2, 3], 3),
               "lists of token ids": ([[1, 2], [3]], 3)}


@pytest.mark.parametrize("value, tokens", list(GOOD_INPUTS.values()), ids=list(GOOD_INPUTS))
async def test_every_form_of_input_is_embedded(harness, value, tokens):
    async with harness(configure=lambda c: c["models"][0].update(endpoints=["embeddings"])) as h:
        out = await h.openai().embeddings.create(model=MODEL, input=value, encoding_format="float")
        assert len(out.data) == (len(value) if isinstance(value, list) and not isinstance(value[0], int) else 1)
        assert out.usage.prompt_tokens == tokens


@pytest.mark.parametrize("field, value, message", [
    ("encoding_format", "int8", '`encoding_format` must be "float" or "base64".'),
    ("dimensions", 0, "`dimensions` must be an integer from 1."),
    ("dimensions", "8", "`dimensions` must be an integer from 1."),
])
async def test_an_encoding_or_dimensions_openai_refuses_is_a_clear_400(harness, field, value, message):
    async with harness(configure=lambda c: c["models"][0].update(endpoints=["embeddings"])) as h:
        with pytest.raises(openai.BadRequestError) as caught:
            await h.openai().embeddings.create(model=MODEL, input="a", **{field: value})
        assert caught.value.body == {"message": message, "type": "invalid_request_error", "param": field,
                                     "code": "invalid_request"}
        assert await h.mock_requests() == []


async def test_the_sdks_default_base64_embeddings_come_back_as_the_same_vectors(harness):
    """The openai SDK asks for base64 unless told otherwise, and decodes it: the mock answers as the model
    servers do, and the gateway relays the strings untouched (float32: the floats as float32 rounds them)."""
    async with harness(configure=lambda c: c["models"][0].update(endpoints=["embeddings"])) as h:
        client = h.openai()
        floats = await client.embeddings.create(model=MODEL, input=["a b", "c"], encoding_format="float")
        raw = await client.embeddings.create(model=MODEL, input=["a b", "c"], encoding_format="base64")
        decoded = await client.embeddings.create(model=MODEL, input=["a b", "c"])
    assert all(isinstance(d.embedding, str) for d in raw.data)
    assert [d.embedding for d in decoded.data] == [array.array("f", e.embedding).tolist() for e in floats.data]
    assert decoded.usage.prompt_tokens == 3 and decoded.usage.model_extra["cost"] == cost(3, 0)
