"""The Batch API in front of the real llama.cpp: a batch of chat lines, one of completion lines and one of
embedding lines, each line through the whole request path to the model server, with the ``openai`` SDK.

Each line's output holds llama.cpp's own answer; its usage row (``batch_id``, the line's
``request_id``) the tokens that answer reports, priced at the model's prices × ``batch_discount``.
"""

from __future__ import annotations

import signal

import openai
import pytest
from batch_inputs import ended, jsonl_lines, submitted

from kilnproxy.testing import usage_row

from .stack import LLAMA_ALIAS, GatewayProcess
from .support import EMBED_ALIAS, KEY, expected_cost, gateway_toml, model_toml

MODEL = "gemma-batch"
EMBED_MODEL = "gemma-batch-embed"
DISCOUNT = 0.5


def discounted(toml: str) -> str:
    return toml.replace("[models.pricing]\n", f"[models.pricing]\nbatch_discount = {DISCOUNT}\n")


@pytest.fixture(scope="module")
def batch_gateway(stack, embedder, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("batches")
    gateway = None
    try:
        config = workdir / "kilnproxy.toml"
        config.write_text(gateway_toml(stack.llama_url, workdir / "usage.db", models=discounted(
            model_toml(MODEL, f'"{stack.llama_url}/v1"', LLAMA_ALIAS)
            + model_toml(EMBED_MODEL, f'"{embedder.url}/v1"', EMBED_ALIAS, ["embeddings"]))))
        gateway = GatewayProcess(workdir, ["--config", str(config)], name="kilnproxy-batches")
        yield gateway, workdir / "usage.db"
    finally:
        if gateway is not None:
            gateway.stop(signal.SIGINT)


LINES = {
    "/v1/chat/completions": [{"model": MODEL, "messages": [{"role": "user", "content": q}], "max_tokens": 8,
                              "stream": True} for q in ("The capital of France is", "Two plus two is")],
    "/v1/completions": [{"model": MODEL, "prompt": p, "max_tokens": 8} for p in ("Once upon a time", "Paris is")],
    "/v1/embeddings": [{"model": EMBED_MODEL, "input": t} for t in ("Paris", "The capital of Italy is Rome.")],
}
OBJECTS = {"/v1/chat/completions": "chat.completion", "/v1/completions": "text_completion",
           "/v1/embeddings": "list"}


@pytest.mark.parametrize("endpoint", list(LINES))
async def test_a_batch_runs_on_llamacpp(batch_gateway, endpoint):
    gateway, db = batch_gateway
    lines = [{"custom_id": f"{endpoint}-{i}", "method": "POST", "url": endpoint, "body": body}
             for i, body in enumerate(LINES[endpoint])]
    async with openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=KEY, max_retries=0) as client:
        _, batch = await submitted(client, lines, endpoint)
        batch = await ended(client, batch.id, timeout=300)
        assert batch.status == "completed", batch
        assert batch.request_counts.model_dump() == {"total": 2, "completed": 2, "failed": 0}
        assert batch.error_file_id is None
        out = jsonl_lines((await client.files.content(batch.output_file_id)).text)
    assert [o["custom_id"] for o in out] == [line["custom_id"] for line in lines]
    for o in out:
        answer = o["response"]["body"]
        assert o["response"]["status_code"] == 200 and answer["object"] == OBJECTS[endpoint]
        row = usage_row(db, o["response"]["request_id"])
        usage = answer["usage"]
        completion = usage.get("completion_tokens", 0)
        assert (row["batch_id"], row["status"], row["stream"]) == (batch.id, 200, 0)  # stream forced off
        assert (row["prompt_tokens"], row["completion_tokens"]) == (usage["prompt_tokens"], completion)
        assert row["prompt_tokens"] > 0 and (completion > 0 or endpoint == "/v1/embeddings")
        if endpoint == "/v1/embeddings":
            assert len(answer["data"]) == 1 and len(answer["data"][0]["embedding"]) > 100
        else:
            text = answer["choices"][0].get("text") or answer["choices"][0]["message"]["content"]
            assert text.strip()
        cached = row["cached_tokens"]
        assert row["cost"] == pytest.approx(expected_cost(row["prompt_tokens"], completion, cached) * DISCOUNT,
                                            abs=1e-12)
