"""The upstreams the benchmark talks to, all on 127.0.0.1.

* ``nginx``: canned answers, so the upstream is never what limits M1-M3 and M8.
  ``POST /json/v1/completions`` returns a vLLM-shaped JSON completion and
  ``POST /sse/v1/completions`` a vLLM-shaped stream of 64 text chunks, the
  finish chunk, the usage chunk and ``[DONE]``, both built with the mock
  upstream's own shapes and served as static files (no proxying, no logs).
  M8's: ``POST /json/v1/embeddings``, one 768-float vector (a retrieval
  query's), and ``POST /sse/v1/responses``, a Responses API stream of
  ``event:`` + ``data:`` pairs with 64 text deltas, both answered by the mock
  upstream's own handlers (in-process, once) with vLLM's shapes.
* ``slow_upstream.py`` (M5): streams that stay open until told to end.
* M4 and M7 use ``python -m kilnproxy mock-upstream --delay 0.005``.
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import orjson

from kilnproxy.mock_servers.mock_upstream import Generation, create_mock_app

UPSTREAM_MODEL = "org/Bench-7B"
CHUNKS = 64
PROMPT = "The capital of France is"
EMBEDDING_DIMENSIONS = 768  # a small embedding model's (nomic-embed-text, EmbeddingGemma)
RESPONSES_EVENTS = CHUNKS + 8  # created, in_progress, item and part added, 64 deltas, text/part/item done, completed


def request_body(stream: bool, model: str = "bench", include_usage: bool = True, **extra) -> bytes:
    body = {"model": model, "prompt": PROMPT, "max_tokens": CHUNKS, "temperature": 0.7}
    if stream:
        body["stream"] = True
        if include_usage:
            body["stream_options"] = {"include_usage": True}
    body.update(extra)
    return orjson.dumps(body)


def _generation(stream: bool) -> Generation:
    body = orjson.loads(request_body(stream, model=UPSTREAM_MODEL))
    opts = {"flavor": "vllm", "delay": 0.0, "context_window": 4096, "prompt_tokens_details": False}
    gen = Generation(body, opts, False, len(PROMPT.split()), CHUNKS)
    gen.id = "cmpl-bench0000000000000000000000000000"
    gen.created = int(time.time())
    return gen


def canned_json() -> bytes:
    return orjson.dumps(_generation(False).whole())


def canned_sse() -> bytes:
    frames = [b"data: " + orjson.dumps(f) + b"\n\n" for f in _generation(True).frames()]
    return b"".join(frames) + b"data: [DONE]\n\n"


def embeddings_body(model: str = "bench-embed") -> bytes:
    return orjson.dumps({"model": model, "input": PROMPT})


def responses_body(model: str = "bench-responses") -> bytes:
    return orjson.dumps({"model": model, "input": PROMPT, "max_output_tokens": CHUNKS, "temperature": 0.7,
                         "stream": True})


def _mock_answer(path: str, body: bytes) -> bytes:
    """What the mock upstream answers ``body`` on ``path`` (vLLM's flavor), run in-process."""
    from aiohttp.test_utils import TestClient, TestServer

    async def ask() -> bytes:
        async with TestClient(TestServer(create_mock_app(flavor="vllm"))) as client:
            resp = await client.post(path, data=body, headers={"Content-Type": "application/json"})
            assert resp.status == 200, (path, resp.status, await resp.text())
            return await resp.read()
    return asyncio.run(ask())


def canned_embeddings() -> bytes:
    """The mock's embeddings answer for one input, its vector widened to a real model's size."""
    body = orjson.loads(embeddings_body(UPSTREAM_MODEL))
    answer = orjson.loads(_mock_answer("/v1/embeddings", orjson.dumps(body)))
    rng = random.Random(0)
    for item in answer["data"]:
        item["embedding"] = [rng.gauss(0.0, 0.036) for _ in range(EMBEDDING_DIMENSIONS)]
    answer["id"] = "embd-bench0000000000000000000000000000"
    return orjson.dumps(answer)


def canned_responses_sse() -> bytes:
    """The mock's Responses API stream: ``event:`` + ``data:`` pairs, ``response.completed`` with the
    usage last, no ``[DONE]``."""
    body = {**orjson.loads(responses_body(UPSTREAM_MODEL)),
            "mock": {"id": "resp_bench0000000000000000000000000000", "created": int(time.time())}}
    raw = _mock_answer("/v1/responses", orjson.dumps(body))
    # the gateway forwards the body without the bench's own fields; the mock echoes only "model"
    assert raw.count(b"\nevent: ") + raw.startswith(b"event: ") == RESPONSES_EVENTS, raw[:300]
    return raw


def write_nginx_files(port: int, workdir: Path) -> Path:
    """The config and the canned answers; returns the config's path.

    nginx answers a POST to a static file with 405; ``error_page 405 =200 $uri``
    turns that into the file itself (an internal GET), which is the cheapest
    canned answer nginx gives to a POST of any size.
    """
    for name, path, body in (("json", "completions", canned_json()), ("sse", "completions", canned_sse()),
                             ("json", "embeddings", canned_embeddings()), ("sse", "responses", canned_responses_sse())):
        folder = workdir / "www" / name / "v1"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / path).write_bytes(body)
    conf = workdir / "nginx.conf"
    conf.write_text(f"""
daemon off;
master_process off;
worker_processes 1;
pid {workdir}/nginx.pid;
error_log {workdir}/nginx-error.log warn;
worker_rlimit_nofile 65536;
events {{ worker_connections 16384; }}
http {{
    access_log off;
    client_body_temp_path {workdir}/nginx-body;
    proxy_temp_path {workdir}/nginx-proxy;
    fastcgi_temp_path {workdir}/nginx-fastcgi;
    uwsgi_temp_path {workdir}/nginx-uwsgi;
    scgi_temp_path {workdir}/nginx-scgi;
    keepalive_requests 100000000;
    keepalive_timeout 300s;
    types {{ }}
    root {workdir}/www;
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        error_page 405 =200 $uri;
        location /json/ {{ default_type application/json; }}
        location /sse/ {{ default_type "text/event-stream; charset=utf-8"; }}
        location = /health {{ return 200 ok; }}
    }}
}}
""")
    return conf
