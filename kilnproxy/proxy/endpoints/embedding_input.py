"""An embeddings request's ``input``, ``encoding_format`` and ``dimensions``, checked as OpenAI's API checks them.

``input`` is a non-empty string, a non-empty list of non-empty strings, a
non-empty list of token ids (integers from 0), or a non-empty list of such
lists; nothing else, and no mix of strings and token lists. Model servers
answer the rest unevenly (an empty text embedded as its special tokens, a
nested list a 500), so the gateway refuses them with a 400 naming the first
item at fault (``input[1][0]``), before any upstream is asked. How many inputs
and how long each is are the model server's to judge (its batch and context
limits; the body's size is bounded by ``server.max_request_bytes``).
"""

from __future__ import annotations

from typing import Any

import orjson

from ...errors import GatewayError, bad_request

FORMS = "a string, a list of strings, a list of token ids, or a list of lists of token ids"
ENCODINGS = ("float", "base64")
SHOWN = 40  # characters of an item at fault quoted in the error


def check_embeddings(body: dict) -> None:
    """400 ``invalid_request`` (``param``: the field) for an ``input``, ``encoding_format`` or
    ``dimensions`` OpenAI's API refuses."""
    value = body.get("input")
    if value is None:
        raise _bad(f"`input` is required: {FORMS}.")
    if isinstance(value, str):
        if not value:
            raise _bad("`input` must not be an empty string.")
    elif isinstance(value, list):
        _check_list(value)
    else:
        raise _bad(f"`input` must be {FORMS}.")
    encoding = body.get("encoding_format")
    if encoding is not None and encoding not in ENCODINGS:
        raise bad_request('`encoding_format` must be "float" or "base64".', param="encoding_format")
    dimensions = body.get("dimensions")
    if dimensions is not None and (type(dimensions) is not int or dimensions < 1):
        raise bad_request("`dimensions` must be an integer from 1.", param="dimensions")


def _check_list(items: list) -> None:
    if not items:
        raise _bad("`input` must not be an empty list.")
    first = items[0]
    if isinstance(first, (int, float)):  # bool too: a list of token ids, each checked
        _check_tokens(items, "input")
        return
    if not isinstance(first, (str, list)):
        raise _bad("`input[0]` must be a string or a list of token ids.")
    kind = "a string" if isinstance(first, str) else "a list of token ids"
    for i, item in enumerate(items):
        if type(item) is not type(first):
            raise _bad(f"`input[{i}]` must be {kind}, as `input[0]` is.")
        if not item:
            raise _bad(f"`input[{i}]` must not be an empty {'string' if isinstance(item, str) else 'list'}.")
        if isinstance(item, list):
            _check_tokens(item, f"input[{i}]")


def _check_tokens(tokens: list, name: str) -> None:
    if all(type(token) is int for token in tokens) and min(tokens, default=0) >= 0:  # the usual case, at C speed
        return
    for i, token in enumerate(tokens):
        if type(token) is not int or token < 0:
            raise _bad(f"`{name}[{i}]` must be a token id (an integer from 0), not {_shown(token)}.")


def _shown(value: Any) -> str:
    try:
        text = orjson.dumps(value).decode()
    except TypeError:  # nested too deep for orjson to write
        text = type(value).__name__
    return text if len(text) <= SHOWN else text[:SHOWN] + "…"


def _bad(message: str) -> GatewayError:
    return bad_request(message, param="input")
