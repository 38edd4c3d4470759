"""Record llama.cpp through the gateway, replay the recording, and the client gets the same bytes.

Each scenario sends one client request to a gateway whose upstream is a
recording pass-through in front of the real llama.cpp, then the same request
to a second gateway whose upstream replays that recording: status, content
type and body must be equal byte for byte (for the client that leaves early:
every byte it read). The recordings are kept: ``make fixtures`` runs this file
with ``--kilnproxy-record kilnproxy/recordings/llamacpp``, which is how the
fixtures that ``make test`` replays (tests/mock_servers/test_recorded_llamacpp.py and
tests/mock_servers/test_recorded_llamacpp_apis.py) are made. The embeddings scenario records
the second llama.cpp, the one started with ``--embeddings`` (conftest's ``embedder``).
"""

from __future__ import annotations

import tomllib
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from kilnproxy.config import parse_config
from kilnproxy.mock_servers.format import load
from kilnproxy.testing import Replay, usage_rows
from kilnproxy.web.server import start_gateway

from .stack import LLAMA_ALIAS
from .support import EMBED_ALIAS, GENERATION_HEADER, KEY, MODEL, gateway_toml
from .test_llama_quirks import DEAD_END, LONG_PROMPT, OVERFLOW_PROMPT

SAMPLING = {"temperature": 0, "seed": 7, "cache_prompt": False}
PROMPT = {"prompt": "The capital of France is"}
CHAT = {"messages": [{"role": "user", "content": "Name the capital of France."}]}
STORY = {"messages": [{"role": "user", "content": "Tell me a long story."}]}
LEAVE_AFTER = 5  # frames the leaving client reads
EMBED_INPUT = {"input": ["Paris", "The capital of Italy is Rome."], "encoding_format": "base64"}  # the SDK's way

# name: (endpoint, client body); the fixture is saved as <name>.json
SCENARIOS = {
    "completions": ("completions", {**PROMPT, "max_tokens": 4, **SAMPLING}),
    "completions-stream": ("completions", {**PROMPT, "max_tokens": 4, **SAMPLING, "stream": True,
                                           "stream_options": {"include_usage": True}}),
    "completions-stream-pings": ("completions", {"prompt": LONG_PROMPT, "max_tokens": 2, **SAMPLING,
                                                 "stream": True, "return_progress": True, "sse_ping_interval": 1}),
    "completions-stream-n2": ("completions", {**PROMPT, "max_tokens": 3, "n": 2, **SAMPLING, "stream": True}),
    "chat": ("chat/completions", {**CHAT, "max_tokens": 4, **SAMPLING}),
    "chat-stream": ("chat/completions", {**CHAT, "max_tokens": 4, **SAMPLING, "stream": True}),
    "chat-n2": ("chat/completions", {**CHAT, "max_tokens": 3, "n": 2, "temperature": 1.0, "seed": 7,
                                     "cache_prompt": False}),
    "completions-stream-over-context": ("completions", {"prompt": OVERFLOW_PROMPT, "max_tokens": 4,
                                                        "stream": True}),
    "completions-stream-error": ("completions", {"prompt": "Say a", **DEAD_END, "stream": True}),
    "completions-500": ("completions", {"prompt": "Say a", **DEAD_END}),
    "chat-stream-client-leaves": ("chat/completions", {**STORY, "max_tokens": 400, "ignore_eos": True,
                                                       **SAMPLING, "stream": True}),
    "responses": ("responses", {"input": "The capital of France is", "max_output_tokens": 4, **SAMPLING}),
    "responses-stream": ("responses", {"input": "The capital of France is", "max_output_tokens": 4, **SAMPLING,
                                       "stream": True}),
    "messages": ("messages", {**CHAT, "max_tokens": 4, **SAMPLING}),
    "messages-stream": ("messages", {**CHAT, "max_tokens": 4, **SAMPLING, "stream": True}),
    "embeddings": ("embeddings", EMBED_INPUT),
}


@asynccontextmanager
async def gateway(upstream: str, folder: Path, upstream_model: str):
    """A gateway with the e2e config in front of ``upstream`` (a base URL without /v1)."""
    toml = gateway_toml(upstream, folder / "usage.db", upstream_model)
    config = parse_config(tomllib.loads(toml), source="<e2e>")
    running = await start_gateway(config)
    try:
        yield running
    finally:
        await running.stop()


async def exchange(http, url: str, upstream: str, endpoint: str, body: dict,
                   leave: bool) -> tuple[int, str, bytes, str]:
    """Status, content type, body (the upstream's URL, named in a 502, as ``UPSTREAM``) and generation id."""
    resp = await http.post(f"{url}/v1/{endpoint}", json={"model": MODEL, **body},
                           headers={"Authorization": f"Bearer {KEY}"})
    try:
        if not leave:
            raw = await resp.read()
        else:
            raw = b""
            while raw.count(b"\n\n") < LEAVE_AFTER:
                raw += await resp.content.readany()
            raw = b"".join(f + b"\n\n" for f in raw.split(b"\n\n")[:LEAVE_AFTER])
        raw = raw.replace(upstream.encode(), b"UPSTREAM")
        return resp.status, resp.headers["Content-Type"], raw, resp.headers[GENERATION_HEADER]
    finally:
        resp.close()


@pytest.mark.parametrize("name", list(SCENARIOS))
async def test_replay_gives_the_client_what_llama_gave(stack, http, tmp_path, kilnproxy_recorder, eventually,
                                                       request, name):
    endpoint, body = SCENARIOS[name]
    leave = name.endswith("client-leaves")
    llama_url, alias = ((request.getfixturevalue("embedder").url, EMBED_ALIAS) if endpoint == "embeddings"
                        else (stack.llama_url, LLAMA_ALIAS))
    (tmp_path / "live").mkdir()
    (tmp_path / "replay").mkdir()
    async with kilnproxy_recorder(llama_url) as rec:
        async with gateway(rec.url, tmp_path / "live", alias) as gw:
            live = await exchange(http, gw.url, rec.url, endpoint, body, leave)
            await eventually(lambda: rec.saved)
        path = rec.saved[-1].replace(rec.saved[-1].with_name(f"{name}.json"))
    fixture = load(path)
    assert fixture.body["model"] == alias and fixture.end == ("client_gone" if leave else "eof")
    assert live[0] == 200 or name in ("completions-500", "completions-stream-over-context"), live

    async with Replay(fixture) as replayer, gateway(replayer.url, tmp_path / "replay", alias) as gw:
        replayed = await exchange(http, gw.url, replayer.url, endpoint, body, leave)
    assert replayed[:3] == live[:3]

    [live_row], [replay_row] = [await eventually(lambda: usage_rows(tmp_path / side / "usage.db", id=r[3]))
                                for side, r in (("live", live), ("replay", replayed))]
    if leave:  # the replay ran ahead of the client: more tokens reached the gateway before it left
        assert live_row["disconnected"] == replay_row["disconnected"] == 1
        return
    keep = ("endpoint", "status", "error_code", "stream", "prompt_tokens", "completion_tokens", "cached_tokens",
            "finish_reason", "cost", "disconnected")
    assert {k: live_row[k] for k in keep} == {k: replay_row[k] for k in keep}
