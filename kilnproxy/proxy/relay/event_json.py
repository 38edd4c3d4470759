"""A streamed event's JSON where orjson refuses it: strings that escape a lone surrogate.

JSON's grammar lets a string escape half a surrogate pair (``"\\ud83d"``; RFC 8259 §8.2 leaves its
meaning to the reader): a server that cuts an emoji between two tokens writes one in each event.
orjson reads and writes strict UTF-8 and refuses them; Python's json module, like the openai SDK
and a browser's ``JSON.parse``, reads them. An event is read by orjson, and by the json module
when orjson refuses it (``read_stdlib``), so that the relay's rules apply to it as to any
event; it is written by orjson, and by the json module what orjson refuses (``write``): UTF-8,
each lone surrogate as the escape it came as. Neither reads what is not JSON (``NaN``, a
number too large for a double, bytes that are not UTF-8). None of this is on the path of an
event orjson reads and writes.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import orjson

# What orjson refuses to write that the json module reads: a string with a lone surrogate, an
# integer beyond 64 bits (orjson reads one as a float). Its other refusals stand: a value that is
# not JSON (a set, a key that is not a string) and JSON nested deeper than 254 levels (orjson reads
# 1,024), the limit a JSON answer has too.
STDLIB_ONLY = ("surrogates not allowed", "exceeds 64-bit range")
# An integer orjson reads as a float (beyond 64 bits) has at least 19 digits (below -2**63; 20 above
# 2**64 - 1). A run of 19 digits covers two successive multiples of 9, so every 9th byte of the JSON
# shows two digits in a row: the usual JSON is looked at in that slice (a ninth of it) and no further.
# Where it shows two, the whole JSON is mapped in one ``translate`` (``SHAPES``) to what tells a number's
# digits from others: an integer of 19 digits or more is one of ``:[,`` or white space, perhaps its sign,
# then 19 digits; a float's fraction follows a ``.``, an id's digits a letter or a ``-`` after one, and
# neither is taken for one. A string holding a space and then 19 digits is read again for nothing.
LONG_RUN = 19
SAMPLE = 9
DIGITS = bytes(0x30 if 0x30 <= b <= 0x39 else 0x20 for b in range(256))  # each digit as "0", all else " "
SHAPES = bytes(0x30 if 0x30 <= b <= 0x39 else 0x20 if b in b":[, \t\n\r" else 0x2D if b == 0x2D else 0x78
               for b in range(256))  # digits as "0", what may come before a value as " ", "-" as itself, else "x"
RUN = b"0" * LONG_RUN
LONG_INTEGERS = (b" " + RUN, b" -" + RUN)


def read_stdlib(payload: bytes) -> Any:
    """``payload`` read by the json module (orjson refused it); ValueError when it is not JSON."""
    try:
        return json.loads(payload.decode(), parse_constant=_not_json, parse_float=_finite, parse_int=_integer)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def exact_integers(raw: bytes, value: Any) -> Any:
    """``value`` (orjson's reading of ``raw``), read again by the json module when ``raw`` holds an integer
    of ``LONG_RUN`` digits or more: orjson reads an integer beyond 64 bits as a float, which would be written
    back as another number (``1.8446744073709552e+19``). The usual JSON costs one slice of a ninth of it;
    one whose sample shows digits (an id's, a vector's floats), a ``translate`` and two ``find`` of it whole."""
    if b"00" not in raw[::SAMPLE].translate(DIGITS):
        return value
    shapes = raw.translate(SHAPES)
    plus, minus = LONG_INTEGERS
    if plus not in shapes and minus not in shapes and not shapes[:64].lstrip(b" -").startswith(RUN):  # or the JSON's
        return value
    try:
        return read_stdlib(raw)
    except ValueError:  # JSON orjson reads that the json module does not (nested too deeply): orjson's
        return value


def read(payload: bytes) -> Any:
    """``payload`` read by orjson, else by the json module; ValueError when it is not JSON."""
    try:
        return orjson.loads(payload)
    except orjson.JSONDecodeError:
        return read_stdlib(payload)


def write(value: Any) -> bytes:
    """``value`` as JSON: orjson's bytes, else the json module's for what only it writes
    (``STDLIB_ONLY``); orjson's TypeError when neither does."""
    try:
        return orjson.dumps(value)
    except TypeError as exc:
        if not any(reason in str(exc) for reason in STDLIB_ONLY):
            raise
        try:
            text = json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError, RecursionError):
            raise exc from None
    return text.encode("utf-8", "backslashreplace")  # a lone surrogate, alone unencodable: its \uXXXX escape


def writable(payload: bytes) -> bool:
    """The event ``payload`` (what the upstream sent) can be written back: a fault writing it once
    plugins changed it was theirs."""
    try:
        write(read(payload))
    except (TypeError, ValueError):
        return False
    return True


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


def _integer(number: str) -> int:
    """An integer, whole; one beyond a double (over 308 digits) is refused, as orjson refuses it."""
    value = int(number)
    if len(number) > 300 and not -sys.float_info.max <= value <= sys.float_info.max:
        raise ValueError(f"{number[:20]}... is beyond a double")
    return value


def _finite(number: str) -> float:
    value = float(number)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"{number} is beyond a double")
    return value
