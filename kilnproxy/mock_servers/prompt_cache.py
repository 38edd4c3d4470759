"""The mock upstream's model of a server's prompt cache, so that cache-aware routing is tested and benchmarked
without GPUs (issue 40).

A model server keeps the tokens of the prompts it served (and the answers it
generated), and a request that begins with the same tokens reuses them: only
the rest is computed. ``PromptCache(slots, prefill_per_token)`` models that
with N slots, as llama.cpp has them, sharing prefixes as vLLM's blocks do:

- a prompt's tokens are a cheap, deterministic split of its text
  (``prompt_tokens_of``): a chat message is four tokens of its own
  (``<|im_start|>``, its role, a separator standing for its content's shape,
  ``<|im_end|>``) and the words of its content, as ``count_tokens`` counts
  them, so ``cached_tokens`` is never more than ``prompt_tokens``;
- a request reuses the longest prefix of its prompt that any slot holds
  (``cached``; never the whole prompt: as the servers do, its last token is
  computed);
- it takes an idle slot to hold its prompt: the one whose tokens its prompt
  continues (they are all its prefix: nothing is lost), the longest; else an
  empty one; else the least recently used, whose tokens are evicted; with
  every slot busy it waits, first come first served (counted as waiting);
- it is held ``prefill_per_token`` seconds for each token not cached (0 by
  default: no delay) and leaves its slot holding its prompt and its answer (a
  chat answer in the form the next turn sends it back), so the next turn of a
  conversation on this server finds them;
- counters as vLLM's ``/metrics`` names them: requests running (holding a
  slot) and waiting, prompt tokens, prefix-cache queries and hits (tokens).

``metrics_text(...)`` is that ``/metrics`` page, in vLLM's V1 form.
"""

from __future__ import annotations

import asyncio
import zlib
from collections import deque
from typing import Any, Sequence

from aiohttp import web

from .json_text import dumps


def prompt_tokens_of(body: dict) -> list[str]:
    """A prompt's tokens, as the mock counts them (``count_tokens``): chat messages' four framing tokens and
    their content's words; a completion prompt's words (a list: each prompt's words, or its token ids)."""
    prompt = body.get("prompt", "")
    if "messages" in body and not isinstance(prompt, list):
        out: list[str] = []
        for message in body.get("messages") or []:
            content = message.get("content") if isinstance(message, dict) else None
            role = str(message.get("role")) if isinstance(message, dict) else "?"
            shape = "\n" if isinstance(content, str) else f"#{zlib.crc32(dumps(content))}"
            out += ["<|im_start|>", role, shape]
            if isinstance(content, str):
                out += content.split()
            out.append("<|im_end|>")
        return out
    if isinstance(prompt, list):
        out = []
        for p in prompt:
            if isinstance(p, list):
                out += [str(t) for t in p]
            elif isinstance(p, int):
                out.append(str(p))
            else:
                out += str(p).split()
        return out
    return str(prompt).split()


def answer_tokens(words: Sequence[str], chat: bool) -> list[str]:
    """What a slot holds after the prompt once the answer is generated: a chat answer framed as the next
    turn sends it back (an assistant message), a completion's words as they follow the prompt."""
    if chat:
        return ["<|im_start|>", "assistant", "\n", *" ".join(words).split(), "<|im_end|>"]
    return " ".join(words).split()


def common_prefix(a: Sequence[str], b: Sequence[str]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # the first index where they differ, by bisection on equal slices
    while lo < hi:
        mid = (lo + hi) // 2
        if a[lo:mid + 1] == b[lo:mid + 1]:
            lo = mid + 1
        else:
            hi = mid
    return lo


class _Slot:
    __slots__ = ("index", "tokens", "busy", "used")

    def __init__(self, index: int):
        self.index = index
        self.tokens: list[str] = []
        self.busy = False
        self.used = 0  # when it was last taken (a counter): the least recently used is evicted first


class Taken:
    """A request's slot: ``cached`` tokens of its prompt were reused; ``prefill()`` waits for the rest."""

    __slots__ = ("slot", "cached", "uncached", "_cache")

    def __init__(self, cache: "PromptCache", slot: _Slot, cached: int, uncached: int):
        self._cache = cache
        self.slot = slot
        self.cached = cached
        self.uncached = uncached

    async def prefill(self) -> None:
        if self._cache.prefill_per_token and self.uncached:
            await asyncio.sleep(self._cache.prefill_per_token * self.uncached)


class PromptCache:
    """``slots`` slots, each holding its last prompt's (and answer's) tokens."""

    def __init__(self, slots: int, prefill_per_token: float = 0.0):
        if slots < 1:
            raise ValueError("a prompt cache needs at least one slot")
        if prefill_per_token < 0:
            raise ValueError("prefill_per_token must be 0 or more")
        self.slots = [_Slot(i) for i in range(slots)]
        self.prefill_per_token = prefill_per_token
        self._queue: deque[asyncio.Future] = deque()
        self._clock = 0
        self.prompt_tokens_total = 0
        self.queries_total = 0  # prompt tokens looked up
        self.hits_total = 0  # of them, found in a slot
        self.requests_total = 0

    @property
    def running(self) -> int:
        return sum(1 for s in self.slots if s.busy)

    @property
    def waiting(self) -> int:
        return sum(1 for f in self._queue if not f.done())

    def take(self, tokens: Sequence[str], then: Sequence[str] = ()) -> Taken | None:
        """An idle slot for ``tokens`` now (None: all busy, or others wait first); it is left holding
        ``tokens`` followed by ``then`` (the answer)."""
        if self.waiting:
            return None
        return self._take(tokens, then)

    def _take(self, tokens: Sequence[str], then: Sequence[str]) -> Taken | None:
        idle = [s for s in self.slots if not s.busy]
        if not idle:
            return None
        shared = {s.index: common_prefix(s.tokens, tokens) for s in self.slots}
        continued = [s for s in idle if s.tokens and shared[s.index] == len(s.tokens)]
        empty = [s for s in idle if not s.tokens]
        if continued:
            best = max(continued, key=lambda s: (len(s.tokens), -s.used))
        elif empty:
            best = empty[0]
        else:
            best = min(idle, key=lambda s: s.used)
        cached = max(0, min(max(shared.values()), len(tokens) - 1))  # the last token is computed
        self._clock += 1
        best.busy, best.used = True, self._clock
        best.tokens = [*tokens, *then]
        self.requests_total += 1
        self.prompt_tokens_total += len(tokens)
        self.queries_total += len(tokens)
        self.hits_total += cached
        return Taken(self, best, cached, len(tokens) - cached)

    async def acquire(self, tokens: Sequence[str], then: Sequence[str] = ()) -> Taken:
        """A slot, waiting (first come, first served) while every one is busy."""
        taken = self.take(tokens, then)
        if taken is not None:
            return taken
        turn = asyncio.get_running_loop().create_future()
        self._queue.append(turn)
        try:
            while True:
                await turn
                taken = self._take(tokens, then)
                if taken is not None:
                    return taken
                turn = asyncio.get_running_loop().create_future()  # (taken meanwhile): first in line again
                self._queue.appendleft(turn)
        finally:
            if not turn.done():
                turn.cancel()
            self._drop_done()
            self._wake()

    def release(self, taken: Taken) -> None:
        taken.slot.busy = False
        self._wake()

    def _wake(self) -> None:
        """The first live waiter gets its turn when a slot is idle."""
        self._drop_done()
        if self._queue and any(not s.busy for s in self.slots):
            self._queue.popleft().set_result(None)

    def _drop_done(self) -> None:
        while self._queue and self._queue[0].done():
            self._queue.popleft()

    def state(self) -> dict[str, Any]:
        """For ``GET /mock/cache``: each slot's token count and state, and the counters."""
        return {"slots": [{"id": s.index, "tokens": len(s.tokens), "busy": s.busy} for s in self.slots],
                "running": self.running, "waiting": self.waiting, "requests": self.requests_total,
                "prompt_tokens": self.prompt_tokens_total, "queries": self.queries_total, "hits": self.hits_total}


PROMPT_CACHE = web.AppKey("prompt_cache", PromptCache)


def metrics_text(model: str, running: int, waiting: int, prompt_tokens: int, queries: int, hits: int) -> str:
    """vLLM's V1 ``/metrics`` families that routing reads (one engine), as prometheus_client writes them."""
    labels = f'{{engine="0",model_name={_quoted(model)}}}'
    families = (
        ("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", running),
        ("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", waiting),
        ("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.", prompt_tokens),
        ("vllm:prefix_cache_queries_total", "counter", "Prefix cache queries, in terms of number of queried tokens.",
         queries),
        ("vllm:prefix_cache_hits_total", "counter", "Prefix cache hits, in terms of number of cached tokens.", hits),
    )
    lines = []
    for name, kind, help_text, value in families:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name}{labels} {float(value)}"]
    return "\n".join(lines) + "\n"


def _quoted(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
