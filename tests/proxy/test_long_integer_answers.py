"""A non-streamed upstream answer holding an integer beyond 64 bits reaches the client with the same digits:
orjson reads such an integer as a float (``1.8446744073709552e+19``), so an answer is read again by the json
module when its bytes hold a run of 19 digits where a number may be (the request side's check)."""

import json

import orjson
import pytest

from kilnproxy.proxy.relay.event_json import LONG_RUN, SAMPLE, exact_integers
from kilnproxy.testing import MODEL

BIG = ["18446744073709551616", "-9223372036854775809", "123456789012345678901234567890"]
FIXED = {"id": "cmpl-fixed", "created": 1700000000}


def field(digits: str) -> bytes:
    return b'"big_integer":' + digits.encode()


@pytest.mark.parametrize("digits", BIG)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_a_json_answer_keeps_the_digits(gw, path, digits):
    body = {"model": MODEL, "max_tokens": 3, "mock": {**FIXED, "big_integer": digits}}
    body.update({"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]})
    async with gw.post(path, body) as resp:
        raw = await resp.read()
    assert resp.status == 200, raw
    assert raw.count(field(digits)) == 1 and b"e+" not in raw
    assert b'"cost":' in raw  # the usage the gateway adds: the answer was read and written back
    assert len(await gw.rows()) == 1


@pytest.mark.parametrize("raw, again", [
    (b'{"id":"cmpl-bench0000000000000000000000000000","n":1}', False),
    (b'{"id":"cmpl-1234567890123456789012","created":1700000000}', False),
    (b'{"a" :\n 18446744073709551616}', True),
    (b'{"a":[1,-9223372036854775809]}', True),
    (b'{"a":"' + b"1" * 40 + b'"}', False),
    (b'{"a":"' + b"1" * 400 + b'"}', False),
    (b'{"a":' + b"1" * 300 + b'}', True),
    (b"1" * 40, True),
    (b'{"x":1' + b"2" * 18 + b"}", True),
    (b'{"x":1' + b"2" * 17 + b"}", False),
    (b'{"v":[0.0025963208202625684123,-0.0025963208202625684123]}', False),  # a float's fraction
    (b'{"v":[-12345678901234567890.5]}', True),  # read again for nothing: the float is the same
])
def test_a_long_run_is_read_again_where_it_is_a_number(raw, again):
    """A run of digits inside a string (an id) or a float's fraction is not an integer: the usual answer,
    an embedding's vector, is not read twice."""
    read = orjson.loads(raw)
    exact = exact_integers(raw, read)
    assert (exact is not read) == again
    assert exact == json.loads(raw)


def test_every_long_integer_is_found_wherever_it_lies():
    """Every offset from a sampled byte, every length from 18 digits to past the window, each sign and end."""
    for pad in range(2 * SAMPLE):
        for digits in range(LONG_RUN - 1, 5 * LONG_RUN):
            for sign, end in (("", "}"), ("-", ',"q":1}'), ("", " }"), ("", "]}")):
                text = '{"p":"' + "x" * pad + '","n":' + ("[" if end == "]}" else "") + sign + "9" * digits + end
                raw = text.encode()
                exact = exact_integers(raw, orjson.loads(raw))
                assert exact == json.loads(raw), (pad, digits, sign, end)
                number = exact["n"][0] if end == "]}" else exact["n"]
                assert type(number) is int, (pad, digits, sign, end)
