"""``kilnproxy.mock_servers.shape``: how an answer is built, never what it says."""

from kilnproxy.mock_servers.shape import differences, shape

SSE = "text/event-stream; charset=utf-8"
VLLM = [b'data: {"id":"a","choices":[{"index":0,"text":" Paris","finish_reason":null}],"usage":null}\n\n',
        b'data: {"id":"a","choices":[{"index":0,"text":"","finish_reason":"length"}],"usage":null}\n\n',
        b'data: {"id":"a","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":1}}\n\n',
        b"data: [DONE]\n\n"]


def test_the_same_shape_whatever_the_text_and_ids():
    other = [c.replace(b" Paris", b" Lyon, a city").replace(b'"a"', b'"zz-9"') for c in VLLM]
    assert differences(shape(200, SSE, VLLM), shape(200, SSE, [b"".join(other)])) == []


def test_framing_usage_placement_fields_and_errors():
    llama = [b':\r\n\r\n', b'event: message\r\nid: 1\r\ndata: {"id":"a","choices":[{"index":0,"text":" Paris",'
             b'"finish_reason":"length"}],"usage":{"prompt_tokens":5,"completion_tokens":1},"timings":{"n":1}}\r\n\r\n',
             b'data: {"error":{"code":500,"message":"m","type":"server_error"}}\r\n\r\n']
    lines = differences(shape(200, SSE, VLLM), shape(200, SSE, llama))
    assert lines == [
        "framing: line ending: 'LF' -> 'CRLF'",
        "framing: comments: [] -> [':']",
        "framing: other fields: [] -> ['event', 'id']",
        "framing: ends with [DONE]: True -> False",
        "framing: error event: 'none' -> 'last event'",
        "usage: 'a separate choices: [] chunk' -> 'in the last choice chunk'",
        "field only in the recording: choices[].finish_reason: null",  # llama.cpp's one chunk has a reason
        "field only in the recording: usage: null",  # and no usage: null chunk
        "field only in the new answer: error.code: number",
        "field only in the new answer: error.message: string",
        "field only in the new answer: error.type: string",
        "field only in the new answer: timings.n: number",
    ]


def test_a_json_answer_and_a_status():
    answer = b'{"choices":[{"index":0,"text":"x","finish_reason":"stop"}],"usage":{"prompt_tokens":1}}'
    assert differences(shape(200, "application/json", [answer]), shape(400, "application/json", [b"{}"])) == [
        "status: 200 -> 400",
        "field only in the recording: choices[].finish_reason: string",
        "field only in the recording: choices[].index: number",
        "field only in the recording: choices[].text: string",
        "field only in the recording: usage.prompt_tokens: number",
        "field only in the new answer: : object",
        "finish reasons: ['stop'] -> []",
        "usage: 'in the answer' -> 'none'",
    ]
