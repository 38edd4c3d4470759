"""Property-based fuzzing of a real gateway process in front of the mock, with Hypothesis.

Bodies (every known field with wrong types, huge numbers, deep nesting, unicode
and NUL, duplicate keys, truncated JSON, compressed or not), headers
(Authorization, Content-Type, Content-Encoding, chunked or not) and paths and
methods go over a raw socket; ``hostile_target.Target`` checks each answer (no
500, every 4xx a JSON error with ``error.code``, one row per generation id) and,
in ``test_end_state`` (the last test of the module), that the process is up, its
log shows no bug and no org has a request left in flight.

``make test`` runs a fixed number of examples with a fixed seed (derandomized),
so a run is repeatable. ``KILNPROXY_FUZZ_EXAMPLES=N`` runs N random examples
per property instead (4 properties: N=25000 is 100,000 requests)::

    KILNPROXY_FUZZ_EXAMPLES=25000 .venv/bin/python -m pytest tests/proxy/test_fuzz.py
"""

from __future__ import annotations

import gzip
import json
import os
import zlib
from urllib.parse import quote

import pytest
import pytest_asyncio
from hostile_target import Target
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rawhttp import exchange, request

from kilnproxy.testing import KEY, MODEL, OTHER_KEY

LONG = int(os.environ.get("KILNPROXY_FUZZ_EXAMPLES", "0"))
FUZZ = settings(max_examples=LONG or 120, derandomize=not LONG, deadline=None, database=None,
                suppress_health_check=list(HealthCheck), print_blob=True)

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def target(tmp_path_factory):
    t = await Target(tmp_path_factory.mktemp("fuzz")).start()
    yield t
    await t.stop()


# -- JSON values and bodies ---------------------------------------------------------------

TEXT = st.text(max_size=30) | st.sampled_from(["", "\x00", "\u2028", "é", "😀" * 5, "\\", '"', "\ufeff"])
LEAF = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.sampled_from([0, 1, -1, 2**63, 2**64, -2**63 - 1])
        | st.floats(allow_nan=False, allow_infinity=False) | TEXT)
VALUE = st.recursive(LEAF, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
                     max_leaves=12)


def plausible_or_any(*plausible):
    return st.one_of(*plausible, VALUE)


SMALL = st.integers(1, 8)
FIELDS = {
    "prompt": plausible_or_any(TEXT, st.lists(TEXT, max_size=3), st.lists(st.integers(0, 50_000), max_size=5)),
    "messages": plausible_or_any(st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant"]), "content": TEXT}), max_size=3)),
    "max_tokens": plausible_or_any(SMALL, st.integers(-5, 5000)),
    "max_completion_tokens": plausible_or_any(SMALL),
    "stream": plausible_or_any(st.sampled_from([True, False, "true", "false", 1, 0, None, "yes", 2, 1.0])),
    "stream_options": plausible_or_any(st.fixed_dictionaries({"include_usage": VALUE}),
                                       st.just({"include_usage": True})),
    "temperature": plausible_or_any(st.floats(-1, 3)),
    "top_p": VALUE, "n": plausible_or_any(SMALL), "stop": VALUE, "seed": VALUE, "logprobs": VALUE,
    "echo": VALUE, "presence_penalty": VALUE, "frequency_penalty": VALUE, "ignore_eos": VALUE, "user": VALUE,
    "suffix": VALUE, "best_of": VALUE, "logit_bias": VALUE, "response_format": VALUE, "tools": VALUE,
}
MODEL_VALUE = st.one_of(st.just(MODEL), st.just(MODEL), st.just(MODEL), TEXT, VALUE)
BODY = st.fixed_dictionaries({"model": MODEL_VALUE}, optional=FIELDS).flatmap(
    lambda d: st.dictionaries(TEXT.filter(lambda k: k != "mock"), VALUE, max_size=3).map(lambda extra: {**extra, **d})
)

# Raw JSON text that no encoder writes: spliced into an otherwise valid body.
ODD_JSON = st.sampled_from([
    '"\\ud800"', '"\\udfff\\ud800"', '"\\u0000"', '1e400', '-1e400', '123456789012345678901234567890',
    '-0', '0.0000000000000000000001', '1E+2', '"\x00"', 'NaN', 'Infinity', 'tru', '"\t"', '[]', '{}',
    '"' + "x" * 70_000 + '"', '[' + ",".join(["1"] * 5000) + ']',
])

# A lone byte, a cut sequence, an encoded surrogate, NUL, a code point beyond U+10FFFF.
NOT_UTF8 = st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x00", b"\xf4\x90\x80\x80"])


@st.composite
def body_bytes(draw) -> bytes:
    body = draw(BODY)
    raw = json.dumps(body, ensure_ascii=draw(st.booleans())).encode("utf-8", "surrogatepass")
    how = draw(st.sampled_from(["as is", "as is", "truncated", "duplicate", "odd", "deep", "top", "bytes",
                                "bad utf8", "empty"]))
    if how == "truncated":
        return raw[:draw(st.integers(0, max(0, len(raw) - 1)))]
    if how == "duplicate":  # the later duplicate wins in most parsers: either may be the valid one
        return b'{"model":' + json.dumps(draw(VALUE)).encode() + b"," + raw[1:]
    if how == "odd":
        return raw[:-1] + b',"odd":' + draw(ODD_JSON).encode("utf-8", "surrogatepass") + b"}"
    if how == "deep":
        depth = draw(st.integers(100, 1100))
        opener, closer = draw(st.sampled_from([(b"[", b"]"), (b'{"a":', b"}")]))
        return raw[:-1] + b',"deep":' + opener * depth + b"1" + closer * depth + b"}"
    if how == "top":
        return json.dumps(draw(VALUE)).encode()
    if how == "bytes":
        return draw(st.binary(max_size=200))
    if how == "bad utf8":
        cut = draw(st.integers(0, len(raw)))
        return raw[:cut] + draw(NOT_UTF8) + raw[cut:]
    if how == "empty":
        return b""
    return raw


# -- headers ----------------------------------------------------------------------------------

VALUE_BYTES = st.binary(max_size=40).map(lambda b: bytes(c for c in b if c >= 0x20 and c != 0x7F))
AUTHORIZATION = st.one_of(
    st.sampled_from([f"Bearer {KEY}", f"Bearer {KEY}", f"Bearer {OTHER_KEY}", f"bearer {KEY}", f"BEARER  {KEY}  ",
                     "Bearer", "Bearer ", f"Basic {KEY}", KEY, "Bearer sk-nope", None]),
    TEXT.map(lambda t: "Bearer " + t.replace("\r", "").replace("\n", "")).filter(lambda v: v.isprintable()),
    VALUE_BYTES.map(lambda b: b"Bearer " + b),
)
CONTENT_TYPE = st.sampled_from([None, "application/json", "application/json; charset=utf-8", "text/plain",
                                "multipart/form-data; boundary=x", "application/x-www-form-urlencoded", "*/*",
                                "application/json; charset=latin-1"])
ENCODING = st.sampled_from([None, None, None, "gzip", "deflate", "x-gzip", "identity", "br", "zstd", "gzip, gzip",
                            "GZIP", "compress", "bogus"])


@st.composite
def headers_for(draw, body: bytes) -> tuple[list[tuple[str, str | bytes]], bytes, bool]:
    """Header lines, the body as sent, and whether the request carries the known key."""
    items: list[tuple[str, str | bytes]] = []
    auth = draw(AUTHORIZATION)
    if auth is not None:
        items.append(("Authorization", auth))
    if draw(st.integers(0, 9)) == 0:
        items.append(("Authorization", draw(AUTHORIZATION) or "Bearer x"))  # a second one
    ctype = draw(CONTENT_TYPE)
    if ctype is not None:
        items.append(("Content-Type", ctype))
    encoding = draw(ENCODING)
    if encoding is not None:
        items.append(("Content-Encoding", encoding))
        if draw(st.booleans()):  # compressed as announced, or not
            if encoding.lower() in ("gzip", "x-gzip"):
                body = gzip.compress(body)
            elif encoding == "deflate":
                body = zlib.compress(body)
    if draw(st.integers(0, 4)) == 0:
        items.append(("Transfer-Encoding", "chunked"))
        body = (b"%x\r\n%s\r\n" % (len(body), body) if body else b"") + b"0\r\n\r\n"
    else:
        items.append(("Content-Length", str(len(body))))
    for _ in range(draw(st.integers(0, 3))):
        items.append((draw(st.sampled_from(["X-Forwarded-For", "Accept", "Accept-Encoding", "Expect", "Connection",
                                            "Origin", "X-Custom"])), draw(VALUE_BYTES)))
    known = auth is not None and _is_known(auth) and not any(
        k == "Authorization" and v != auth for k, v in items)
    return items, body, known


def _is_known(auth: str | bytes) -> bool:
    if isinstance(auth, bytes):
        try:
            auth = auth.decode()
        except UnicodeDecodeError:
            return False
    return auth[:7].lower() == "bearer " and auth[7:].strip() == KEY


# -- paths ------------------------------------------------------------------------------------

SEGMENT = st.text(max_size=20).map(lambda t: quote(t, safe=""))
PATH = st.one_of(
    st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/credits", "/healthz", "/metrics",
                     "/ui/", "/ui", "/ui/api/meta", "/ui/api/events?x", "//v1/completions", "/v1//completions",
                     "/v1/completions/", "/v1/completions/../completions", "/v1/completions?%zz", "/%00", "/ui/api/x",
                     "/admin/reload", "/v1/models/%2e%2e%2f"]),
    SEGMENT.map(lambda s: f"/v1/models/{s}"),
    SEGMENT.map(lambda s: f"/v1/generations/{s}"),
    SEGMENT.map(lambda s: f"/ui/api/requests/{s}"),
    SEGMENT.map(lambda s: f"/ui/static/{s}"),
    st.tuples(st.sampled_from(["org", "model", "status", "limit", "before", "bucket", "since", "until", "token"]),
              SEGMENT).map(lambda kv: f"/ui/api/requests?{kv[0]}={kv[1]}&bucket={kv[1]}"),
    st.tuples(st.sampled_from(["bucket", "since", "until", "org"]), SEGMENT).map(
        lambda kv: f"/ui/api/usage?{kv[0]}={kv[1]}"),
    SEGMENT.map(lambda s: "/" + s),
)
METHOD = st.sampled_from(["GET", "POST", "POST", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "TRACE"])


async def send(target: Target, method: str, path: str, items, body: bytes, known: bool) -> None:
    if "/ui/api/events" in path and method == "GET":
        return  # the live feed never ends by design
    resp = await exchange(target.url, request(method, path, items, body, length=False))
    target.check(resp, method=method, path=path, known_key=known)


# -- the properties ---------------------------------------------------------------------------


@FUZZ
@given(body=body_bytes(), path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
async def test_any_body(target, body, path):
    items = [("Authorization", f"Bearer {KEY}"), ("Content-Type", "application/json"),
             ("Content-Length", str(len(body)))]
    await send(target, "POST", path, items, body, True)


@FUZZ
@given(data=st.data(), path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/models"]))
async def test_any_headers(target, data, path):
    body = data.draw(st.one_of(body_bytes(), st.just(json.dumps({"model": MODEL, "prompt": "hi",
                                                                  "max_tokens": 2}).encode())))
    items, body, known = data.draw(headers_for(body))
    await send(target, "POST" if path != "/v1/models" else "GET", path, items, body, known)


@FUZZ
@given(data=st.data(), method=METHOD, path=PATH)
async def test_any_path_and_method(target, data, method, path):
    body = data.draw(st.one_of(st.just(b""), body_bytes()))
    auth = data.draw(st.sampled_from([f"Bearer {KEY}", f"Bearer {OTHER_KEY}", "Bearer nope", None]))
    items = [("Authorization", auth)] if auth else []
    items.append(("Content-Length", str(len(body))))
    await send(target, method, path, items, body, auth == f"Bearer {KEY}")


@FUZZ
@given(data=st.data(), method=METHOD, path=PATH)
async def test_anything_at_once(target, data, method, path):
    items, body, known = data.draw(headers_for(data.draw(body_bytes())))
    await send(target, method, path, items, body, known)


async def test_end_state(target, eventually):
    """After every example above: the process is up, its log is clean, nothing is left in flight."""
    assert target.requests > 0
    await target.check_end(eventually)
