"""Fixtures of the end-to-end tests: one llama.cpp server and one kilnproxy for the whole run.

``make e2e`` installs the two packages and runs ``pytest tests/e2e``; the main
``make test`` does not collect this folder (``tests/conftest.py``). Both
servers are stopped when the session ends, whatever way it ends.
"""

from __future__ import annotations

import signal

import aiohttp
import openai
import pytest

from .stack import GatewayProcess, LlamaServer
from .support import EMBED_ALIAS, KEY, Stack, gateway_toml


@pytest.fixture(scope="session")
def stack(tmp_path_factory) -> Stack:
    workdir = tmp_path_factory.mktemp("e2e")
    db = workdir / "usage.db"
    llama = LlamaServer(workdir)
    gateway = None
    try:
        config = workdir / "kilnproxy.toml"
        config.write_text(gateway_toml(llama.url, db))
        gateway = GatewayProcess(workdir, ["--config", str(config)])
        yield Stack(llama, gateway, db, workdir)
    finally:
        if gateway is not None:
            gateway.stop(signal.SIGINT)  # no drain: the run is over
        llama.stop()


@pytest.fixture(scope="session")
def embedder(tmp_path_factory) -> LlamaServer:
    """A second, one-slot llama.cpp that serves ``/v1/embeddings`` (as ``EMBED_ALIAS``), started on first use.

    llama.cpp serves embeddings only when started with ``--embeddings``, and with a pooling other
    than ``none`` (Gemma's own, which ``/v1/embeddings`` refuses)."""
    server = LlamaServer(tmp_path_factory.mktemp("embedder"), alias=EMBED_ALIAS, parallel=1,
                         extra=("--embeddings", "--pooling", "mean"), name="llama-server-embeddings")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def http():
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture
async def client(stack):
    """The official SDK, pointed at the gateway."""
    async with openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key=KEY, max_retries=0) as c:
        yield c
