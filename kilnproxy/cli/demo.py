"""The built-in demo: a gateway in front of the embedded mock model (running it (docs/reference.md)).

``serve --upstream URL`` puts the same demo in front of a real model server instead:
its own models (its ``GET /v1/models`` list, read again every minute) under their own
ids, and ``kiln-demo`` for the first of them (``discover = true`` with an empty prefix).
"""

from __future__ import annotations

import os
from pathlib import Path

from ..config import Config, parse_config

DEMO_KEY = "sk-kiln-demo"
DEMO_MODEL = "kiln-demo"


def demo_config(upstream_url: str, host: str, port: int, discover: bool = False) -> Config:
    model = {"id": "", "discover": True, "alias": DEMO_MODEL} if discover else {"id": DEMO_MODEL}
    return parse_config({
        "server": {"host": host, "port": port},
        "storage": {"path": "kilnproxy.db"},
        "models": [{
            **model,
            "endpoints": ["completions", "chat/completions", "embeddings", "responses", "messages"],
            "upstreams": [upstream_url],
            "upstream_model": "mock-vllm",
            "context_window": 4096,
            "pricing": {"prompt": 0.10, "completion": 0.30, "cached_prompt": 0.05},
        }],
        "orgs": [{"id": "demo", "credits": 5.0}],
        "keys": [{"key": DEMO_KEY, "org": "demo", "id": "demo-key"}],
        "inspector": {"capture": True},  # the demo's requests are yours: show their bodies and streams at /ui/
    }, source="<demo>", base_dir=Path.cwd(), environ=os.environ)  # KILNPROXY__<TABLE>__<KEY> apply to it too


def banner(url: str, upstream: str | None = None, models: list[str] | None = None) -> str:
    model = f"the model server at {upstream}" if upstream else "an embedded mock model"
    served = f"\n  models:  {', '.join(models)}" if models and models != [DEMO_MODEL] else ""
    return f"""kilnproxy demo on {url}  (no config given: {model}, usage in ./kilnproxy.db)

  dev key: {DEMO_KEY}   model: {DEMO_MODEL}   inspector: {url}/ui/{served}

  curl -N {url}/v1/completions \\
    -H "Authorization: Bearer {DEMO_KEY}" -H "Content-Type: application/json" \\
    -d '{{"model": "{DEMO_MODEL}", "prompt": "The capital of France is", "max_tokens": 12, "stream": true}}'
"""
