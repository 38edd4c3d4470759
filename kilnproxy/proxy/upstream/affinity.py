"""``cache_aware`` routing's rules (SPEC 13): a request's affinity key, its order of the upstreams, the choice.

``affinity_key(endpoint, body)`` reduces the opening of a request (its body
already parsed) to a 32-bit integer, or None for a request routed ``least_busy``:

- ``prompt_cache_key``, when it is a string, is the key (OpenAI's field; sent on unchanged);
- chat (``chat/completions``): the messages up to and including the first
  ``user`` message (all of them when none is ``user``);
- Messages: ``system`` and the first message;
- Responses: ``instructions`` and the first input item, or the input string;
- completions: the first 2,000 characters of the prompt, of its first element
  when it is a list of prompts; a prompt of token ids: its first 2,000 ids;
- embeddings, token counts, and a body whose opening is missing or not of
  those shapes (the upstream will refuse it): None.

The opening is written as JSON with sorted keys (so a client that orders a
message's fields differently from one turn to the next keeps its key) and
reduced with CRC-32, which, unlike Python's ``hash()``, is the same in every
process, and is the cheapest hash at hand (zlib's: about 1.5 GB/s here, where
SHA-1 runs at 0.7 and BLAKE2b at 0.3): it runs on every request. Two openings
that share a key share an upstream, which costs nothing but balance, and the
bounded load keeps that.

``Rendezvous(urls).order(key)`` is the key's order of the upstreams (their
indexes): highest random weight first, each weight a 64-bit mix (MurmurHash3's
finaliser) of the key and a BLAKE2b hash of the URL; it depends on nothing
but the key and the URL strings, so every replica and every restart gives
the same order, and removing an upstream (or marking it down) moves only the
keys it was first for.

``choose(order, up, loads, slack)`` is the attempt order of one request: the
upstreams that are up and whose load is below the bound
⌈(1 + slack) × (L + 1) / n⌉ + 1 (L: the loads of the n upstreams up, summed),
in the key's order, then the other upstreams up, in the key's order (the
failover). Its first is the choice; one below the bound always exists, as
the least loaded is below the mean. ``effective_load`` is SPEC 13's load: the
larger of this replica's requests in flight and the server's own count.
"""

from __future__ import annotations

import math
import zlib
from hashlib import blake2b
from typing import Any, Mapping, Sequence

import orjson

PROMPT_CHARS = 2000  # completions: the prompt's first characters (or token ids) that make its key
_SORTED = orjson.OPT_SORT_KEYS


def affinity_key(endpoint: str, body: Mapping[str, Any]) -> int | None:
    """The affinity key of a request to ``endpoint`` (``chat/completions``, ``completions``,
    ``messages``, ``responses``; any other: None) whose body is ``body``; None when it has no opening."""
    cache_key = body.get("prompt_cache_key")
    if isinstance(cache_key, str):
        return _digest(b"k", cache_key)
    if endpoint == "chat/completions":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        for i, message in enumerate(messages):
            if isinstance(message, dict) and message.get("role") == "user":
                return _digest(b"c", messages[:i + 1])
        return _digest(b"c", messages)
    if endpoint == "completions":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a list of prompts: the first one
        if isinstance(prompt, (str, list)) and prompt:
            return _digest(b"p", prompt[:PROMPT_CHARS])
        return None
    if endpoint == "messages":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        return _digest(b"m", [body.get("system"), messages[0]])
    if endpoint == "responses":
        given = body.get("input")
        if isinstance(given, list):
            if not given:
                return None
            given = given[0]
        elif not isinstance(given, str):
            return None
        return _digest(b"r", [body.get("instructions"), given])
    return None


def _digest(kind: bytes, opening: Any) -> int:
    if isinstance(opening, str):
        data = opening.encode("utf-8", "surrogatepass")
    else:
        try:
            data = orjson.dumps(opening, option=_SORTED)
        except TypeError:  # a lone surrogate or an integer beyond 64 bits, as the body allows: its repr
            data = repr(opening).encode("utf-8", "surrogatepass")
    return zlib.crc32(data, zlib.crc32(kind))


class Rendezvous:
    """The per-key orders of a fixed list of upstream URLs (highest random weight first)."""

    __slots__ = ("urls", "cached", "_salts", "_orders")

    def __init__(self, urls: Sequence[str], cached: int = 16384):
        self.urls = tuple(urls)
        self.cached = cached  # keys whose order is kept (a conversation's next turns find theirs at once)
        self._orders: dict[int, tuple[int, ...]] = {}
        self._salts = tuple(int.from_bytes(blake2b(url.encode("utf-8", "surrogatepass"), digest_size=8).digest(),
                                           "big") for url in self.urls)

    def weights(self, key: int) -> list[int]:
        """Each URL's weight for ``key``: MurmurHash3's 64-bit finaliser of the key (spread over 64
        bits) XOR the URL's salt."""
        spread = (key * _GOLDEN) & _MASK
        out = []
        for salt in self._salts:
            h = spread ^ salt
            h ^= h >> 33
            h = (h * 0xFF51AFD7ED558CCD) & _MASK
            h ^= h >> 33
            h = (h * 0xC4CEB9FE1A85EC53) & _MASK
            out.append(h ^ (h >> 33))
        return out

    def order(self, key: int) -> tuple[int, ...]:
        """The indexes of ``urls``, the key's first upstream first (equal weights: by URL); the last
        ``cached`` keys' orders are kept (all of them dropped when full: no bookkeeping per request)."""
        order = self._orders.get(key)
        if order is None:
            if len(self._orders) >= self.cached:
                self._orders.clear()
            order = self._orders[key] = self._order(key)
        return order

    def _order(self, key: int) -> tuple[int, ...]:
        weights = self.weights(key)
        if len(set(weights)) == len(weights):
            return tuple(sorted(range(len(weights)), key=weights.__getitem__, reverse=True))
        urls = self.urls
        return tuple(sorted(range(len(urls)), key=lambda i: (-weights[i], urls[i])))


_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # 2^64 / φ: a 32-bit key spread over the 64 bits


def bound(loads_up: Sequence[int], slack: float) -> int:
    """The load an upstream must be below to take a request: ⌈(1 + slack) × (L + 1) / n⌉ + 1."""
    return math.ceil((1 + slack) * (sum(loads_up) + 1) / len(loads_up)) + 1


def choose(order: Sequence[int], up: Sequence[bool], loads: Sequence[int], slack: float) -> list[int]:
    """The attempt order of a request whose key's order is ``order``: the upstreams up and below the
    bound, then the other upstreams up, each in the key's order (``up`` and ``loads`` by index);
    empty when none is up."""
    total = n = 0
    for i in order:
        if up[i]:
            total += loads[i]
            n += 1
    if not n:
        return []
    limit = math.ceil((1 + slack) * (total + 1) / n) + 1  # bound(), inline: this runs per request
    below: list[int] = []
    over: list[int] = []
    for i in order:
        if up[i]:
            (below if loads[i] < limit else over).append(i)
    return below + over


def effective_load(in_flight: int, server: int | None) -> int:
    """SPEC 13's load of an upstream: the larger of this replica's requests in flight to it and the
    server's own count (None: unknown, so this replica's alone)."""
    return in_flight if server is None or server < in_flight else server
