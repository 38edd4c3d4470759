"""What the end-to-end tests share: the gateway's config, the stack, and readers of its state.

The usage rows are read straight from the gateway's SQLite file; llama.cpp's
own state from its ``/metrics``, ``/slots`` and ``/tokenize`` endpoints.
"""

from __future__ import annotations

import asyncio
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import orjson

from kilnproxy.testing import usage_row, usage_rows
from kilnproxy.usage import round_usd

from .stack import LLAMA_ALIAS, N_CTX_PER_SLOT, GatewayProcess, LlamaServer

MODEL = "gemma-e2e"  # the catalog id; llama.cpp calls it LLAMA_ALIAS, so every chunk's model is rewritten
EMBED_ALIAS = "gemma3-270m-embed"  # the second llama.cpp, started with --embeddings (conftest's ``embedder``)
ENDPOINTS = ["completions", "chat/completions", "embeddings", "responses", "messages"]
KEY = "sk-e2e-acme"
TIGHT_KEY = "sk-e2e-tight"  # org "tight": max_in_flight = TIGHT_LIMIT
TIGHT_LIMIT = 3
PRICING = {"prompt": 0.5, "completion": 1.5, "cached_prompt": 0.25}  # USD per million tokens


def model_toml(model_id: str, upstream: str, upstream_model: str, endpoints: list[str] = ENDPOINTS,
               extra: str = "") -> str:
    """One ``[[models]]`` table at the e2e prices; ``upstream``: a TOML value (a quoted URL or a table),
    ``extra``: more lines of the table (``queue_timeout = 120``)."""
    return textwrap.dedent(f"""\
        [[models]]
        id = "{model_id}"
        upstreams = [{upstream}]
        upstream_model = "{upstream_model}"
        context_window = {N_CTX_PER_SLOT}
        endpoints = {orjson.dumps(endpoints).decode()}
        {extra}
        [models.pricing]
        prompt = {PRICING["prompt"]}
        completion = {PRICING["completion"]}
        cached_prompt = {PRICING["cached_prompt"]}

        """)


def gateway_toml(llama_url: str, db: Path, upstream_model: str = LLAMA_ALIAS, models: str | None = None) -> str:
    """The e2e gateway: ``MODEL`` served by the llama.cpp at ``llama_url`` (as ``upstream_model``), on
    every endpoint (the stack's llama.cpp answers embeddings with a 501: only ``embedder`` serves them);
    or the ``[[models]]`` tables given."""
    if models is None:
        models = model_toml(MODEL, f'"{llama_url}/v1"', upstream_model)
    return textwrap.dedent(f"""\
        [server]
        host = "127.0.0.1"
        port = 0

        [storage]
        path = "{db}"

        """) + models + textwrap.dedent(f"""\
        [[orgs]]
        id = "acme"
        credits = 100.0
        max_in_flight = 16

        [[orgs]]
        id = "tight"
        credits = 100.0
        max_in_flight = {TIGHT_LIMIT}

        [[keys]]
        key = "{KEY}"
        org = "acme"
        id = "acme-key"

        [[keys]]
        key = "{TIGHT_KEY}"
        org = "tight"
        id = "tight-key"

        [plugins]
        modules = []
        entry_points = false
        """)


@dataclass
class Stack:
    llama: LlamaServer
    gateway: GatewayProcess
    db: Path
    workdir: Path

    @property
    def llama_url(self) -> str:
        return self.llama.url

    @property
    def url(self) -> str:
        return self.gateway.url


def expected_cost(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> float:
    """The model's pricing applied to token counts, as the gateway must compute it (rounded as it rounds)."""
    micro = (prompt_tokens - cached_tokens) * PRICING["prompt"] + cached_tokens * PRICING["cached_prompt"]
    micro += completion_tokens * PRICING["completion"]
    return round_usd(micro / 1_000_000)


def rows(stack: Stack, **where) -> list[dict]:
    """The gateway's usage rows, read straight from its SQLite file."""
    return usage_rows(stack.db, **where)


def row(stack: Stack, generation_id: str) -> dict:
    """The row of that id, waited for (a lone request's row reaches the table a moment after its response)."""
    return usage_row(stack.db, generation_id)


async def wait_for_row(stack: Stack, generation_id: str, seconds: float = 30.0) -> dict:
    """The row of a request whose client left early: it is written once the gateway has seen it go."""
    async with asyncio.timeout(seconds):
        while not rows(stack, id=generation_id):
            await asyncio.sleep(0.05)
    return row(stack, generation_id)


async def llama_metric(http: aiohttp.ClientSession, stack: Stack | LlamaServer, name: str) -> float:
    """One of llama.cpp's own ``/metrics`` (``llamacpp:<name>``), of the stack's server or another."""
    async with http.get(f"{stack.url if isinstance(stack, LlamaServer) else stack.llama_url}/metrics") as resp:
        text = await resp.text()
    match = re.search(rf"^llamacpp:{name} (\S+)$", text, re.M)
    assert match, f"llama.cpp's /metrics has no {name}"
    return float(match.group(1))


async def llama_busy_slots(http: aiohttp.ClientSession, llama_url: str) -> int:
    """How many of llama.cpp's slots are processing a request now (its /slots)."""
    async with http.get(f"{llama_url}/slots") as resp:
        slots = await resp.json()
    return sum(1 for s in slots if s["is_processing"])


async def wait_llama_idle(http: aiohttp.ClientSession, stack: Stack | LlamaServer, seconds: float = 60.0) -> None:
    """Until no llama.cpp slot is processing (read from its /slots)."""
    url = stack.url if isinstance(stack, LlamaServer) else stack.llama_url
    async with asyncio.timeout(seconds):
        while await llama_busy_slots(http, url):
            await asyncio.sleep(0.05)


async def prompt_tokens(http: aiohttp.ClientSession, stack: Stack, text: str) -> int:
    """How many tokens llama.cpp makes of ``text`` as a prompt (with its BOS), from its /tokenize."""
    async with http.post(f"{stack.llama_url}/tokenize", json={"content": text, "add_special": True}) as resp:
        return len((await resp.json())["tokens"])


GENERATION_HEADER = "X-Neocloud-Generation-Id"


def frames(raw: bytes) -> list[bytes]:
    """Split a raw SSE body into its frames, checking the gateway's framing on the way.

    Every frame is one ``data: ...`` line or one comment line, each followed by
    a blank line; the body ends right after ``data: [DONE]``.
    """
    assert raw.endswith(b"data: [DONE]\n\n"), raw[-200:]
    parts = raw[:-2].split(b"\n\n")
    for part in parts:
        assert b"\n" not in part and b"\r" not in part, part
        assert part.startswith(b"data: ") or part.startswith(b":"), part
    assert parts.count(b"data: [DONE]") == 1
    return parts


def events(parts: list[bytes]) -> list[dict]:
    """The JSON events among ``frames()``, without comments and ``[DONE]``."""
    return [orjson.loads(p[6:]) for p in parts if p.startswith(b"data: {")]
