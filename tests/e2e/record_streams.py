"""Record real streams from llama.cpp into ``tests/data/streams`` for the relay's comparison tests.

    python -m tests.e2e.record_streams     (after ``make e2e`` has installed llama.cpp and the model)

Starts ``llama-server`` with Gemma 3 270M as the end-to-end tests do and saves
the raw body of a few streamed answers (completions and chat, with and without
``include_usage``), byte for byte, as ``llamacpp-<name>.sse``.
``tests/proxy/relay/test_relay_chunks.py`` cuts them at random and checks that the relay's
chunk path gives what the event-by-event path gives.
"""

from __future__ import annotations

import json
import tempfile
import urllib.request
from pathlib import Path

from .stack import LLAMA_ALIAS, LlamaServer

OUT = Path(__file__).resolve().parents[1] / "data" / "streams"
PROMPT = "The capital of France is"
ANSWERS = {
    "completions-usage": ("completions", {"prompt": PROMPT, "max_tokens": 40, "stream_options": {"include_usage": True}}),
    "completions": ("completions", {"prompt": PROMPT, "max_tokens": 12}),
    "chat-usage": ("chat/completions", {"messages": [{"role": "user", "content": "Name three rivers."}],
                                        "max_tokens": 40, "stream_options": {"include_usage": True}}),
    "chat-stop": ("chat/completions", {"messages": [{"role": "user", "content": "Say hello."}],
                                       "max_tokens": 60}),
}


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        llama = LlamaServer(Path(tmp))
        try:
            for name, (endpoint, body) in ANSWERS.items():
                data = json.dumps({"model": LLAMA_ALIAS, "stream": True, "temperature": 0, "seed": 42,
                                   **body}).encode()
                request = urllib.request.Request(f"{llama.url}/v1/{endpoint}", data=data,
                                                 headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(request, timeout=120) as resp:
                    raw = resp.read()
                (OUT / f"llamacpp-{name}.sse").write_bytes(raw)
                print(f"{name}: {len(raw)} bytes, {raw.count(b'data: ')} events")
        finally:
            llama.stop()


if __name__ == "__main__":
    main()
