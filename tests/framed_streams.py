"""The framed streams of the Responses API and Anthropic Messages, for tests against upstreams without the
mock (proxy/endpoints/, proxy/relay/): ``event`` writes one framed event (``<HIGH>``/``<LOW>`` in it as the
escapes of a lone surrogate, ``lone``), ``responses_stream`` and ``messages_stream`` (+ ``MESSAGES_END``)
whole streams, ``response`` a Responses object; ``serving(url, endpoint)`` configures the test model on such
an upstream, ``claude(h)`` is the Anthropic SDK on a gateway, ``failed_messages_stream`` one stream read raw
and by the SDK; ``cost`` prices tokens at the test config's prices (``PROMPT``, ``COMPLETION`` a token)."""

import anthropic
import orjson
import pytest

from kilnproxy.testing import MODEL


PROMPT, COMPLETION = 0.10 / 1e6, 0.30 / 1e6


HIGH, LOW = "\\ud83d", "\\ude00"  # the two halves of U+1F600, as a JSON escape each


def cost(prompt: int, completion: int) -> float:
    return round(prompt * PROMPT + completion * COMPLETION, 10)


def lone(data: bytes) -> bytes:
    """``data`` with each ``"HIGH"``/``"LOW"`` written as the escape of that lone surrogate."""
    return data.replace(b"<HIGH>", HIGH.encode()).replace(b"<LOW>", LOW.encode())


def event(kind: str, **data) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + lone(orjson.dumps({"type": kind, **data})) + b"\n\n"


def serving(url: str, endpoint: str):
    return lambda config: config["models"][0].update(upstreams=[url], endpoints=[endpoint])


def claude(h) -> anthropic.AsyncAnthropic:
    client = anthropic.AsyncAnthropic(base_url=h.url, api_key=h.key, max_retries=0)
    h._clients.append(client)
    return client


def response(status: str, text: str | None, usage: dict | None) -> dict:
    output = [] if text is None else [{"id": "msg_1", "type": "message", "status": "completed", "role": "assistant",
                                       "content": [{"type": "output_text", "text": text, "annotations": []}]}]
    return {"id": "resp_1", "object": "response", "created_at": 1, "status": status, "model": "org/Up-7B",
            "output": output, "usage": usage}


USAGE = {"input_tokens": 2, "output_tokens": 2, "total_tokens": 4}


CUT_TEXT = "Hi <HIGH>"  # max_output_tokens stopped the answer in the middle of an emoji


def responses_stream(final: dict) -> list[bytes]:
    item = {"id": "msg_1", "type": "message", "status": "in_progress", "role": "assistant", "content": []}
    return [event("response.created", sequence_number=0, response=response("in_progress", None, None)),
            event("response.output_item.added", sequence_number=1, output_index=0, item=item),
            event("response.output_text.delta", sequence_number=2, item_id="msg_1", output_index=0, content_index=0,
                  delta="Hi "),
            event("response.output_text.delta", sequence_number=3, item_id="msg_1", output_index=0, content_index=0,
                  delta="<HIGH>"),
            event("response.output_text.done", sequence_number=4, item_id="msg_1", output_index=0, content_index=0,
                  text=CUT_TEXT),
            event("response.completed", sequence_number=5, response=final)]


MESSAGE = {"id": "msg_1", "type": "message", "role": "assistant", "model": "org/Up-7B", "content": [],
           "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 3, "output_tokens": 1}}


def messages_stream(*texts: str) -> list[bytes]:
    return [event("message_start", message=MESSAGE),
            event("content_block_start", index=0, content_block={"type": "text", "text": ""}),
            *[event("content_block_delta", index=0, delta={"type": "text_delta", "text": t}) for t in texts]]


MESSAGES_END = [event("content_block_stop", index=0),
                event("message_delta", delta={"stop_reason": "end_turn", "stop_sequence": None},
                      usage={"output_tokens": 3}),
                event("message_stop")]


async def failed_messages_stream(h) -> tuple[bytes, dict, anthropic.APIStatusError]:
    """The same streamed ``/v1/messages`` request through ``h`` twice: raw (its bytes and its usage row), then by
    the Anthropic SDK, which must raise; returns the bytes, the row and what the SDK raised."""
    body = {"model": MODEL, "max_tokens": 9, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    async with h.post("/v1/messages", body) as resp:
        assert resp.status == 200
        raw = await resp.read()
        row = await h.row(resp.headers["X-Neocloud-Generation-Id"])
    with pytest.raises(anthropic.APIStatusError) as caught:
        async with claude(h).messages.stream(model=MODEL, max_tokens=9,
                                              messages=[{"role": "user", "content": "hi"}]) as stream:
            async for _ in stream:
                pass
    return raw, row, caught.value
