"""The upstreams the benchmark talks to, all on 127.0.0.1.

* ``nginx``: canned answers, so the upstream is never what limits M1-M3.
  ``POST /json/v1/completions`` returns a vLLM-shaped JSON completion and
  ``POST /sse/v1/completions`` a vLLM-shaped stream of 64 text chunks, the
  finish chunk, the usage chunk and ``[DONE]``, both built with the mock
  upstream's own shapes and served as static files (no proxying, no logs).
* ``slow_upstream.py`` (M5): streams that stay open until told to end.
* M4 uses ``python -m kilnproxy mock-upstream --delay 0.005``.
"""

from __future__ import annotations

import time
from pathlib import Path

import orjson

from kilnproxy.fixtures.mock_upstream import _Generation

UPSTREAM_MODEL = "org/Bench-7B"
CHUNKS = 64
PROMPT = "The capital of France is"


def request_body(stream: bool, model: str = "bench", include_usage: bool = True, **extra) -> bytes:
    body = {"model": model, "prompt": PROMPT, "max_tokens": CHUNKS, "temperature": 0.7}
    if stream:
        body["stream"] = True
        if include_usage:
            body["stream_options"] = {"include_usage": True}
    body.update(extra)
    return orjson.dumps(body)


def _generation(stream: bool) -> _Generation:
    body = orjson.loads(request_body(stream, model=UPSTREAM_MODEL))
    opts = {"flavor": "vllm", "delay": 0.0, "context_window": 4096, "prompt_tokens_details": False}
    gen = _Generation(body, opts, False, len(PROMPT.split()), CHUNKS)
    gen.id = "cmpl-bench0000000000000000000000000000"
    gen.created = int(time.time())
    return gen


def canned_json() -> bytes:
    return orjson.dumps(_generation(False).whole())


def canned_sse() -> bytes:
    frames = [b"data: " + orjson.dumps(f) + b"\n\n" for f in _generation(True).frames()]
    return b"".join(frames) + b"data: [DONE]\n\n"


def write_nginx_files(port: int, workdir: Path) -> Path:
    """The config and the canned answers; returns the config's path.

    nginx answers a POST to a static file with 405; ``error_page 405 =200 $uri``
    turns that into the file itself (an internal GET), which is the cheapest
    canned answer nginx gives to a POST of any size.
    """
    for name, body in (("json", canned_json()), ("sse", canned_sse())):
        folder = workdir / "www" / name / "v1"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "completions").write_bytes(body)
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
