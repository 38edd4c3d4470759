"""Embeddings, the Responses API and Anthropic Messages, through the gateway to the real llama.cpp.

Each request is sent with the client a user would use (the ``openai`` SDK for
embeddings and responses, the ``anthropic`` SDK for messages), and its usage
row is checked against the usage the SDK saw and against what llama.cpp itself
counted: its ``/metrics`` counters (prompt tokens it evaluated, tokens it
predicted) or its ``/tokenize``.

llama.cpp serves embeddings only when started with ``--embeddings`` (and a
pooling other than ``none``: Gemma's own is ``none``, which ``/v1/embeddings``
refuses), so a second, one-slot server serves them (conftest's ``embedder``). The
stack's server, without ``--embeddings``, answers ``/v1/embeddings`` with 501,
which the gateway turns into a 502 with one row.
"""

from __future__ import annotations

import asyncio
import math
import signal

import aiohttp
import anthropic
import openai
import orjson
import pytest

from kilnproxy.testing import usage_row, usage_rows

from .stack import LLAMA_ALIAS, GatewayProcess, LlamaServer
from .support import (
    EMBED_ALIAS,
    GENERATION_HEADER,
    KEY,
    expected_cost,
    gateway_toml,
    llama_metric,
    model_toml,
    wait_llama_idle,
)

MODEL = "gemma-apis"  # the stack's llama.cpp: completions, responses, messages (and embeddings, which it refuses)
EMBED_MODEL = "gemma-embed"  # the embeddings server
AUTH = {"Authorization": f"Bearer {KEY}"}


class Apis:
    def __init__(self, stack, embedder: LlamaServer, gateway: GatewayProcess, db):
        self.stack, self.embedder, self.gateway, self.db = stack, embedder, gateway, db

    @property
    def url(self) -> str:
        return self.gateway.url

    def row(self, generation_id: str) -> dict:
        return usage_row(self.db, generation_id)


@pytest.fixture(scope="module")
def apis(stack, embedder, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("apis")
    gateway = None
    try:
        config = workdir / "kilnproxy.toml"
        config.write_text(gateway_toml(stack.llama_url, workdir / "usage.db", models=(
            model_toml(MODEL, f'"{stack.llama_url}/v1"', LLAMA_ALIAS)
            + model_toml(EMBED_MODEL, f'"{embedder.url}/v1"', EMBED_ALIAS, ["embeddings"]))))
        gateway = GatewayProcess(workdir, ["--config", str(config)], name="kilnproxy-apis")
        yield Apis(stack, embedder, gateway, workdir / "usage.db")
    finally:
        if gateway is not None:
            gateway.stop(signal.SIGINT)  # no drain: nothing is in flight


@pytest.fixture
async def oai(apis):
    async with openai.AsyncOpenAI(base_url=f"{apis.url}/v1", api_key=KEY, max_retries=0) as c:
        yield c


@pytest.fixture
async def claude(apis):
    async with anthropic.AsyncAnthropic(base_url=apis.url, api_key=KEY, max_retries=0) as c:
        yield c


class LlamaCounts:
    """llama.cpp's own count of one request: the prompt tokens it evaluated (its cache's not) and the
    tokens it predicted, as the difference of its /metrics counters around the request."""

    def __init__(self, http: aiohttp.ClientSession, stack):
        self.http, self.stack = http, stack

    async def _read(self) -> tuple[float, float]:
        return (await llama_metric(self.http, self.stack, "prompt_tokens_total"),
                await llama_metric(self.http, self.stack, "tokens_predicted_total"))

    async def __aenter__(self) -> LlamaCounts:
        await wait_llama_idle(self.http, self.stack)
        self.before = await self._read()
        return self

    async def __aexit__(self, *exc) -> None:
        if exc[0] is None:
            await wait_llama_idle(self.http, self.stack)
            after = await self._read()
            self.evaluated, self.predicted = (int(a - b) for a, b in zip(after, self.before))


def assert_row(row: dict, *, endpoint: str, stream: bool, prompt: int, completion: int, cached: int,
               cost: float, finish_reason: str | None) -> None:
    assert (row["model"], row["requested_model"], row["endpoint"], row["stream"], row["status"],
            row["error_code"], row["disconnected"]) == (
        MODEL if endpoint != "embeddings" else EMBED_MODEL, MODEL if endpoint != "embeddings" else EMBED_MODEL,
        endpoint, int(stream), 200, None, 0)
    assert (row["prompt_tokens"], row["completion_tokens"], row["cached_tokens"], row["total_tokens"]) == (
        prompt, completion, cached, prompt + completion)
    assert row["cost"] == cost == expected_cost(prompt, completion, cached) and cost > 0
    assert row["finish_reason"] == finish_reason


# --- embeddings ---------------------------------------------------------------------------------------


async def test_embeddings_with_the_openai_sdk(apis, oai, http):
    inputs = ["Paris", "The capital of Italy is Rome."]
    raw = await oai.embeddings.with_raw_response.create(model=EMBED_MODEL, input=inputs)
    answer = raw.parse()  # the SDK asked for base64 (its default) and decoded it
    generation_id = raw.headers[GENERATION_HEADER]

    # llama.cpp's own answer to the same input, as floats
    async with http.post(f"{apis.embedder.url}/v1/embeddings",
                         json={"model": EMBED_ALIAS, "input": inputs, "encoding_format": "float"}) as resp:
        theirs = await resp.json()
    assert answer.model == EMBED_MODEL
    assert [d.index for d in answer.data] == [0, 1]
    for ours, expected in zip(answer.data, theirs["data"], strict=True):
        assert len(ours.embedding) == len(expected["embedding"]) > 0
        assert all(math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-5)
                   for a, b in zip(ours.embedding, expected["embedding"], strict=True))

    # the prompt tokens: llama.cpp's own count of each input (with its BOS), and what it reported
    counted = 0
    for text in inputs:
        async with http.post(f"{apis.embedder.url}/tokenize", json={"content": text, "add_special": True}) as resp:
            counted += len((await resp.json())["tokens"])
    assert answer.usage.prompt_tokens == theirs["usage"]["prompt_tokens"] == counted
    cost = answer.usage.model_extra["cost"]
    assert_row(apis.row(generation_id), endpoint="embeddings", stream=False, prompt=counted, completion=0,
               cached=0, cost=cost, finish_reason=None)


async def test_embeddings_on_a_server_without_them_is_a_502_with_one_row(apis, http):
    # llama.cpp's own answer: 501 and an error of its own
    async with http.post(f"{apis.stack.llama_url}/v1/embeddings",
                         json={"model": LLAMA_ALIAS, "input": "Paris"}) as resp:
        assert resp.status == 501
        assert (await resp.json())["error"]["type"] == "not_supported_error"
    # more times than upstream_max_failures (3): a 501 says nothing of the server's health
    for _ in range(4):
        async with http.post(f"{apis.url}/v1/embeddings", json={"model": MODEL, "input": "Paris"},
                             headers=AUTH) as resp:
            assert resp.status == 502
            assert "answered HTTP 501 on /embeddings" in await resp.text()
            generation_id = resp.headers[GENERATION_HEADER]
        r = apis.row(generation_id)
        assert (r["endpoint"], r["status"], r["error_code"], r["cost"]) == ("embeddings", 502, "upstream_error", 0.0)
    # the server is not marked down: its other endpoints are still served
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
    async with http.post(f"{apis.url}/v1/completions", json=body, headers=AUTH) as resp:
        assert resp.status == 200


# --- the Responses API --------------------------------------------------------------------------------


async def test_responses_with_the_openai_sdk(apis, oai, http):
    async with LlamaCounts(http, apis.stack) as llama:
        raw = await oai.responses.with_raw_response.create(
            model=MODEL, input="The capital of France is", max_output_tokens=8, temperature=0)
        answer = raw.parse()
    generation_id = raw.headers[GENERATION_HEADER]
    assert answer.model == MODEL and answer.status == "completed"
    assert answer.output_text
    usage = answer.usage
    cached = usage.input_tokens_details.cached_tokens
    assert (usage.output_tokens, usage.input_tokens - cached) == (llama.predicted, llama.evaluated)
    assert usage.output_tokens == 8
    assert_row(apis.row(generation_id), endpoint="responses", stream=False, prompt=usage.input_tokens,
               completion=usage.output_tokens, cached=cached, cost=usage.model_extra["cost"],
               finish_reason="completed")


async def test_responses_streamed_with_the_openai_sdk(apis, oai, http):
    async with LlamaCounts(http, apis.stack) as llama:
        raw = await oai.responses.with_raw_response.create(
            model=MODEL, input="Write about the sea.", max_output_tokens=10, temperature=0, stream=True)
        generation_id = raw.headers[GENERATION_HEADER]
        kinds, text = [], []
        async for event in raw.parse():
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                text.append(event.delta)
            if event.type == "response.completed":
                completed = event.response
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "".join(text) == completed.output_text
    assert completed.model == MODEL
    usage = completed.usage
    cached = usage.input_tokens_details.cached_tokens
    assert (usage.output_tokens, usage.input_tokens - cached) == (llama.predicted, llama.evaluated)
    assert_row(apis.row(generation_id), endpoint="responses", stream=True, prompt=usage.input_tokens,
               completion=usage.output_tokens, cached=cached, cost=usage.model_extra["cost"],
               finish_reason="completed")


# --- Anthropic Messages -------------------------------------------------------------------------------


async def test_messages_with_the_anthropic_sdk(apis, claude, http):
    async with LlamaCounts(http, apis.stack) as llama:
        raw = await claude.messages.with_raw_response.create(
            model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Name a colour."}])
        answer = await raw.parse()
    generation_id = raw.headers[GENERATION_HEADER]
    assert answer.model == MODEL and answer.stop_reason == "max_tokens"
    assert answer.content[0].type == "text" and answer.content[0].text
    usage = answer.usage
    read = usage.cache_read_input_tokens or 0
    prompt = usage.input_tokens + read + (usage.cache_creation_input_tokens or 0)
    assert (usage.output_tokens, prompt - read) == (llama.predicted, llama.evaluated)
    assert_row(apis.row(generation_id), endpoint="messages", stream=False, prompt=prompt,
               completion=usage.output_tokens, cached=read, cost=usage.model_extra["cost"],
               finish_reason="max_tokens")


async def test_messages_streamed_with_the_anthropic_sdk(apis, claude, http):
    delta_usage = None
    async with LlamaCounts(http, apis.stack) as llama:
        async with claude.messages.stream(model=MODEL, max_tokens=10,
                                          messages=[{"role": "user", "content": "Tell me about the moon."}]) as stream:
            generation_id = stream.response.headers[GENERATION_HEADER]
            async for event in stream:
                if event.type == "message_delta":
                    delta_usage = event.usage
            final = await stream.get_final_message()
    assert final.model == MODEL and final.stop_reason == "max_tokens" and final.content[0].text
    usage = final.usage  # message_start's prompt counts and message_delta's output count, as the SDK adds them up
    read = usage.cache_read_input_tokens or 0
    prompt = usage.input_tokens + read + (usage.cache_creation_input_tokens or 0)
    assert (usage.output_tokens, prompt - read) == (llama.predicted, llama.evaluated)
    assert delta_usage.output_tokens == usage.output_tokens
    assert_row(apis.row(generation_id), endpoint="messages", stream=True, prompt=prompt,
               completion=usage.output_tokens, cached=read, cost=delta_usage.model_extra["cost"],
               finish_reason="max_tokens")


async def test_client_leaving_a_messages_stream_is_billed_once_and_llama_stops(apis, claude, http):
    await wait_llama_idle(http, apis.stack)
    predicted_before = await llama_metric(http, apis.stack, "tokens_predicted_total")
    got = 0
    async with claude.messages.stream(model=MODEL, max_tokens=1000,
                                      messages=[{"role": "user", "content": "Write a long story."}]) as stream:
        generation_id = stream.response.headers[GENERATION_HEADER]
        async for event in stream:
            if event.type == "content_block_delta":
                got += 1
                if got == 3:
                    break
    # the SDK closed the connection: the gateway closes llama.cpp's, which stops generating
    async with asyncio.timeout(30):
        while not usage_rows(apis.db, id=generation_id):
            await asyncio.sleep(0.05)
    await wait_llama_idle(http, apis.stack, seconds=10)
    predicted = await llama_metric(http, apis.stack, "tokens_predicted_total") - predicted_before
    assert predicted < 200  # far from the 1000 asked for
    r = apis.row(generation_id)
    assert (r["endpoint"], r["stream"], r["status"], r["disconnected"]) == ("messages", 1, 200, 1)
    assert r["prompt_tokens"] > 0 and got <= r["completion_tokens"] <= predicted
    assert r["cost"] == expected_cost(r["prompt_tokens"], r["completion_tokens"], r["cached_tokens"]) > 0


async def test_count_tokens_is_forwarded_and_not_metered(apis, http):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "How many tokens is this?"}]}
    async with http.post(f"{apis.stack.llama_url}/v1/messages/count_tokens",
                         json={**body, "model": LLAMA_ALIAS}) as resp:
        theirs = await resp.json()
    rows_before = len(usage_rows(apis.db))
    async with http.post(f"{apis.url}/v1/messages/count_tokens", json=body,
                         headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"}) as resp:
        assert resp.status == 200
        assert await resp.json() == theirs and theirs["input_tokens"] > 0
    assert len(usage_rows(apis.db)) == rows_before


# --- the streams' own framing, byte for byte ----------------------------------------------------------


def _blank(value, renamed: str):
    """An event's JSON with what differs between two runs blanked (ids, times, llama.cpp's timings,
    the usage, compared on its own) and the gateway's changes undone (model renamed)."""
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if k in ("id", "item_id", "created_at", "completed_at", "timings", "usage"):
                out[k] = "-"
            elif k == "model":
                out[k] = LLAMA_ALIAS if v == renamed else v
            else:
                out[k] = _blank(v, renamed)
        return out
    if isinstance(value, list):
        return [_blank(v, renamed) for v in value]
    return value


def _split(raw: bytes) -> list[tuple[list[bytes], dict]]:
    assert raw.endswith(b"\n\n") and b"[DONE]" not in raw
    out = []
    for frame in raw[:-2].split(b"\n\n"):
        lines = frame.split(b"\n")
        assert [line[:6] for line in lines] == [b"event:", b"data: "], frame
        out.append((lines[:-1], orjson.loads(lines[-1][6:])))
    return out


@pytest.mark.parametrize("endpoint", ["responses", "messages"])
async def test_streams_keep_llamas_framing(apis, http, endpoint):
    """The gateway's stream is llama.cpp's own, frame for frame, ``event:`` lines unchanged and no
    ``[DONE]`` added: only the model renamed and the cost added to the final usage."""
    if endpoint == "responses":
        body = {"input": "The capital of France is", "max_output_tokens": 6}
    else:
        body = {"messages": [{"role": "user", "content": "The capital of France is"}], "max_tokens": 6}
    body = {**body, "temperature": 0, "stream": True}
    await wait_llama_idle(http, apis.stack)
    async with http.post(f"{apis.stack.llama_url}/v1/{endpoint}", json={**body, "model": LLAMA_ALIAS}) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        theirs = _split(await resp.read())
    async with http.post(f"{apis.url}/v1/{endpoint}", json={**body, "model": MODEL}, headers=AUTH) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
        generation_id = resp.headers[GENERATION_HEADER]
        ours = _split(await resp.read())

    assert [lines for lines, _ in ours] == [lines for lines, _ in theirs]  # the event: lines, unchanged
    assert [_blank(e, MODEL) for _, e in ours] == [_blank(e, MODEL) for _, e in theirs]
    if endpoint == "responses":
        final = ours[-1][1]["response"]
        assert final["model"] == MODEL
        usage = final["usage"]
        prompt, completion = usage["input_tokens"], usage["output_tokens"]
        cached = usage["input_tokens_details"]["cached_tokens"]
        assert {k: v for k, v in usage.items() if k != "cost"} == theirs[-1][1]["response"]["usage"] | {
            "input_tokens_details": usage["input_tokens_details"]}  # the cache may differ between the two runs
        finish = "completed"
    else:
        start = ours[0][1]["message"]
        assert start["model"] == MODEL
        delta, = [e for _, e in ours if e["type"] == "message_delta"]
        usage = delta["usage"]
        assert "cost" not in start["usage"]
        read = start["usage"].get("cache_read_input_tokens", 0)
        prompt, completion, cached = start["usage"]["input_tokens"] + read, usage["output_tokens"], read
        finish = "max_tokens"
    assert completion == 6
    assert usage["cost"] == expected_cost(prompt, completion, cached)
    assert_row(apis.row(generation_id), endpoint=endpoint, stream=True, prompt=prompt, completion=completion,
               cached=cached, cost=usage["cost"], finish_reason=finish)
