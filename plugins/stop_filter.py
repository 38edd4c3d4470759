"""stop_filter: end a generation cleanly when the model writes a banned word or stop sequence.

The gateway enforces it, whatever the client asked and whether or not the
model server supports ``stop``: the text is cut just before the first match,
``finish_reason`` becomes ``"stop"``, and on a stream the gateway closes the
upstream request so the model stops generating (the client still gets the
usage chunk it asked for, then ``data: [DONE]``). Install::

    [plugins]
    modules = ["plugins/stop_filter.py"]

    [plugins.settings.stop_filter]
    sequences = ["BEGIN PRIVATE KEY", "</answer>"]
    case_sensitive = false   # default

Streams: a sequence is found even when the model writes it across several
events, but the part of it in earlier events has already reached the client;
only the event that completes it is cut. With ``n`` > 1 each choice stops on
its own, and the stream ends when every choice has stopped. Non-streamed
answers are cut the same way (``text`` or ``message.content``).
"""

from __future__ import annotations

import re

from kilnproxy import DROP, STOP, hookimpl

NAME = "stop_filter"


def pattern_for(settings) -> re.Pattern | None:
    sequences = settings.get("sequences") or []
    if not sequences:
        return None
    flags = 0 if settings.get("case_sensitive", False) else re.IGNORECASE
    return re.compile("|".join(re.escape(s) for s in sequences), flags)


class Filter:
    """What one streamed request needs: the pattern, and per choice the text's tail."""

    __slots__ = ("pattern", "keep", "tails", "stopped", "n")

    def __init__(self, pattern: re.Pattern, longest: int, n: int):
        self.pattern = pattern
        self.keep = longest - 1  # a match can start this far back in the text already sent
        self.tails: dict[int, str] = {}
        self.stopped: set[int] = set()
        self.n = n

    def cut(self, index: int, text: str) -> str | None:
        """``text`` up to the first match (``None`` when there is none), counting what came before."""
        tail = self.tails.get(index, "")
        seen = tail + text
        match = self.pattern.search(seen)
        if match is None:
            self.tails[index] = seen[-self.keep:] if self.keep else ""
            return None
        self.stopped.add(index)
        return text[:max(0, match.start() - len(tail))]


@hookimpl
def startup(gateway):
    settings = gateway.plugin_settings(NAME)
    sequences = settings.get("sequences", [])
    if not isinstance(sequences, list) or not all(isinstance(s, str) and s for s in sequences):
        raise ValueError("[plugins.settings.stop_filter] sequences must be a list of non-empty strings")


@hookimpl
def rewrite_request(call, body):
    if not call.stream:
        return
    settings = call.settings(NAME)
    pattern = pattern_for(settings)
    if pattern is not None:
        n = body.get("n")
        call.state[NAME] = Filter(pattern, max(map(len, settings["sequences"])), n if type(n) is int else 1)


@hookimpl
def transform_event(call, event):
    flt = call.state.get(NAME)
    choices = event["choices"]
    if flt is None or not choices:
        return None
    kept = []
    for choice in choices:
        index = choice.get("index", 0)
        if index in flt.stopped:
            continue  # this choice has ended; later pieces of it are not sent
        kept.append(choice)
        delta = choice.get("delta")
        holder, key = (delta, "content") if isinstance(delta, dict) else (choice, "text")
        text = holder.get(key)
        if not text:
            continue
        cut = flt.cut(index, text)
        if cut is not None:
            holder[key] = cut
            choice["finish_reason"] = "stop"
    if not kept:
        return DROP
    choices[:] = kept
    return STOP if len(flt.stopped) >= flt.n else None


@hookimpl
def transform_response(call, body):
    pattern = pattern_for(call.settings(NAME))
    if pattern is None:
        return
    for choice in body.get("choices") or ():
        message = choice.get("message")
        holder, key = (message, "content") if isinstance(message, dict) else (choice, "text")
        text = holder.get(key)
        match = pattern.search(text) if isinstance(text, str) else None
        if match is not None:
            holder[key] = text[:match.start()]
            choice["finish_reason"] = "stop"
