"""Prompt tokens by model and upstream, as each upstream reported them: its prompt-cache hit rate (SPEC 13).

``UpstreamTokens.count(model, upstream, prompt, cached)`` runs once per request whose row names a
model and an upstream, where the row is built (``Gateway.submit``): two adds to a list found by one
dict lookup. ``counts`` maps ``(model, upstream)`` (the row's ``upstream``: the URL as written,
userinfo removed) to ``[prompt_tokens, cached_tokens]`` since this process started, in the order the
pairs were first seen. ``/metrics`` (``kilnproxy_upstream_prompt_tokens_total`` and
``kilnproxy_upstream_cached_tokens_total``) and the inspector's upstreams view both read these
counts, so the two always agree.
"""

from __future__ import annotations


class UpstreamTokens:
    """This process's prompt and cached tokens per ``(model, upstream)``."""

    __slots__ = ("counts",)

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str], list[int]] = {}

    def count(self, model: str, upstream: str, prompt: int, cached: int) -> None:
        counts = self.counts.get((model, upstream))
        if counts is None:
            counts = self.counts[(model, upstream)] = [0, 0]
        counts[0] += prompt
        counts[1] += cached
