"""The streamed response: upstream SSE -> rules of SPEC section 5 -> plugins -> client.

``EventRelay`` decides, event by event, what the client gets. Events that no
rule and no plugin changes are forwarded as the upstream's own bytes without
being parsed: the checks that decide this are substring tests on the bytes,
prepared once per model. An event is parsed only when it carries usage, an
error or a finish reason, names the model differently, or a
``transform_event`` plugin is loaded.

Usage, wherever the upstream puts it (vLLM's ``choices: []`` chunk, llama.cpp's
last choice chunk, Ollama's zeros on every chunk, vLLM's running totals), is
removed from the chunks as they pass and comes back as exactly one
``choices: []`` chunk, priced, just before ``[DONE]``, when the client asked
for it. The last counts reported win, except that zeros never replace counts,
and that a stream with several choices (``n`` > 1) may report each choice on
its own: llama.cpp puts each choice's usage in that choice's last chunk, or in
a ``choices: []`` chunk per choice on chat. Then the reports are combined
(``Usage.combined``: completions added, the prompt counted once).
"""

from __future__ import annotations

import logging
from itertools import repeat
from typing import Any

import orjson

from .call import DROP, STOP, Call
from .errors import plugin_failed
from .plugins import Impl, call_impl
from .record import RequestRecord
from .sse import COMMENT, DONE, DONE_FRAME, SSEParser, data_frame
from .upstream import Route
from .usage import Usage

log = logging.getLogger("kilnproxy.plugins")


# A chat stream's opening chunk names the role and carries no token: not counted
# when the completion tokens must be counted from what was streamed.
ROLE = b'"role":'


class EventRelay:
    __slots__ = ("call", "route", "record", "impls", "parse_all", "rename", "ended", "error",
                 "usage_raw", "usage_event", "last_event", "clean_end", "choice_usage", "request_usage")

    def __init__(self, call: Call, route: Route, record: RequestRecord, impls: tuple[Impl, ...]):
        self.call = call
        self.route = route
        self.record = record
        self.impls = impls
        self.parse_all = bool(impls)
        self.rename = route.model_bytes != route.upstream_model_bytes
        self.ended = False  # [DONE], an error event, or a plugin's STOP: read no further
        self.error: bytes | None = None
        self.usage_raw: dict | None = None
        self.usage_event: dict | None = None
        self.last_event: dict | None = None
        self.clean_end = False  # the upstream sent [DONE]
        self.choice_usage: dict[Any, Usage] = {}  # the latest report on each choice's chunks, by index
        self.request_usage: list[Usage] = []  # the reports of choices: [] chunks

    # -- per chunk ----------------------------------------------------------

    def feed_chunk(self, parser: SSEParser, chunk: bytes) -> bytes:
        """``feed(parser.feed(chunk))``; leading events that no rule changes go in one piece.

        When a chunk holds several events (an upstream that is ahead of us), its
        first events up to one that carries usage, an error, a finish reason or
        ``[DONE]`` are checked and forwarded together, with a few substring counts
        over the whole run instead of parsing it line by line. ``_unchanged`` must
        accept only what ``_event`` forwards as it is: a new per-event rule needs its
        marker in ``_CUT`` (tests/test_relay_chunks.py compares both paths).
        """
        if len(chunk) < BULK_BYTES or self.parse_all or not parser.idle():
            return self.feed(parser.feed(chunk))  # one token's event or a few: the usual case
        end = _plain_prefix(chunk)
        if not end:
            return self.feed(parser.feed(chunk))
        head = chunk[:end]
        n = head.count(b"\n\n")
        if not self._unchanged(head, n):
            return self.feed(parser.feed(chunk))
        if self.rename:
            head = head.replace(self.route.upstream_model_bytes, self.route.model_bytes)
        self.record.streamed_chunks += n - head.count(ROLE)  # as _event: a role-only chunk is no token
        return head if end == len(chunk) else head + self.feed(parser.feed(chunk[end:]))

    def _unchanged(self, head: bytes, n: int) -> bool:
        """``head`` is ``n`` one-line ``data:`` events that ``_event`` would forward as they are
        (renamed)."""
        if (head[:6] != b"data: " or head.count(b"\n") != 2 * n or head.count(b"\n\ndata: ") != n - 1
                or head.count(b'"finish_reason"') != head.count(b'"finish_reason":null')):
            return False
        if not self.rename:
            return True
        if self.route.model_bytes in head:
            return False
        parts = head.split(self.route.upstream_model_bytes)
        # one in each event: an event boundary between every two occurrences
        return len(parts) == n + 1 and all(map(bytes.__contains__, parts[1:-1], repeat(b"\n\n")))

    # -- per event ----------------------------------------------------------

    def feed(self, items: list[tuple[int, bytes]]) -> bytes:
        """The bytes to send for these parsed SSE items (possibly none)."""
        out = []
        for kind, payload in items:
            if kind == COMMENT:
                out.append(payload + b"\n\n")
                continue
            if payload == DONE:
                self.ended = self.clean_end = True
                break
            frame = self._event(payload)
            if frame is not None:
                out.append(frame)
            if self.ended:
                break
        return b"".join(out)

    def _event(self, payload: bytes) -> bytes | None:
        if not self.parse_all and (
            (b'"usage"' not in payload or b'"usage":null' in payload)
            and b'"error"' not in payload
            and (b'"finish_reason"' not in payload or b'"finish_reason":null' in payload)
        ):
            if not self.rename or self.route.model_bytes in payload:
                self.record.streamed_chunks += ROLE not in payload
                return data_frame(payload)
            if self.route.upstream_model_bytes in payload:
                self.record.streamed_chunks += ROLE not in payload
                return data_frame(payload.replace(self.route.upstream_model_bytes, self.route.model_bytes, 1))
        return self._parsed_event(payload)

    def _parsed_event(self, payload: bytes) -> bytes | None:
        try:
            event = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return data_frame(payload)  # not ours to judge; the client sees what was sent
        if not isinstance(event, dict):
            return data_frame(payload)
        if "error" in event or event.get("object") == "error":
            return self._upstream_error(event)
        choices = event.get("choices")
        usage = event.get("usage")
        if isinstance(usage, dict):
            self._take_usage(usage, choices)
            if not choices:
                self.usage_event = event
                return None
            event["usage"] = None
        if choices:
            self.record.streamed_chunks += ROLE not in payload
            if not self.parse_all:
                self._take_finish_reason(choices)
        if "model" in event:
            event["model"] = self.call.model
        self.last_event = event
        if self.parse_all:
            verdict = self._transform(event)
            if verdict is DROP:
                return None
            if verdict is STOP:
                self.ended = True
            self._take_finish_reason(event.get("choices"))  # what the client sees
            return self._dump(event)
        return data_frame(orjson.dumps(event))

    def _take_finish_reason(self, choices: Any) -> None:
        for choice in choices or ():
            reason = choice.get("finish_reason") if isinstance(choice, dict) else None
            if reason:
                self.record.finish_reason = reason

    def _take_usage(self, usage: dict, choices: Any) -> None:
        counts = Usage.from_upstream(usage)
        if counts.is_zero():  # Ollama's placeholder zeros: not a report
            return
        self.usage_raw = usage
        if choices:  # on a choice's chunk: the latest count of that choice replaces the one before
            index = choices[0].get("index") if isinstance(choices[0], dict) else None
            self.choice_usage[index if type(index) is int else 0] = counts
        else:  # a choices: [] chunk: the whole request's (vLLM), or one choice's of several (llama.cpp chat)
            self.request_usage.append(counts)
        self.record.usage = Usage.combined(self.request_usage or list(self.choice_usage.values()))

    def _upstream_error(self, event: dict) -> bytes:
        if "error" not in event:  # vLLM before 0.10.1: a flat error object
            event = {"error": {k: v for k, v in event.items() if k != "object"}}
        error = event["error"]
        code = error.get("code") if isinstance(error, dict) else None
        self.record.error_code = code if isinstance(code, str) else "upstream_error"
        self.error = data_frame(orjson.dumps(event))
        self.ended = True
        return self.error

    def _transform(self, event: dict) -> Any:
        kwargs = {"call": self.call, "event": event}
        verdict = None
        for impl in self.impls:
            try:
                result = call_impl(impl, kwargs)
            except Exception as exc:
                log.error("plugin %r raised in transform_event", impl.plugin, exc_info=exc)
                raise StreamPluginError(impl.plugin, exc) from exc
            if result is STOP or result is DROP:
                verdict = result if verdict is None else verdict
        return verdict

    def _dump(self, event: dict) -> bytes:
        try:
            return data_frame(orjson.dumps(event))
        except TypeError as exc:  # a plugin put something in the event that is not JSON
            names = ", ".join(impl.plugin for impl in self.impls)
            raise StreamPluginError(names, TypeError(f"the event is no longer JSON: {exc}")) from exc

    # -- the end --------------------------------------------------------------

    def tail(self) -> bytes:
        """What follows the last event: the usage chunk if asked for, then ``[DONE]``."""
        if self.error is not None or not self.call.include_usage:
            return DONE_FRAME
        event = self._usage_event()
        if not self.parse_all:
            return data_frame(orjson.dumps(event)) + DONE_FRAME
        try:
            if self._transform(event) is DROP:
                return DONE_FRAME
            return self._dump(event) + DONE_FRAME
        except StreamPluginError as exc:
            self.record.error_code = exc.error.code
            return exc.frame() + DONE_FRAME

    def _usage_event(self) -> dict:
        usage = self.record.final_usage()
        event = self.usage_event
        if event is None:
            base = self.last_event or {}
            event = {k: base[k] for k in ("id", "object", "created") if k in base}
            if "object" not in event:
                event["object"] = "chat.completion.chunk" if self.call.endpoint == "chat/completions" \
                    else "text_completion"
        event["model"] = self.call.model
        event["choices"] = []
        raw = dict(self.usage_raw) if self.usage_raw is not None else {
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens,
        }
        if self.usage_raw is not None and usage != Usage.from_upstream(self.usage_raw):  # combined reports
            raw.update(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                       total_tokens=usage.total_tokens)
            details = raw.get("prompt_tokens_details")
            if isinstance(details, dict):
                raw["prompt_tokens_details"] = {**details, "cached_tokens": usage.cached_tokens}
        raw["cost"] = usage.cost(self.call.pricing)
        event["usage"] = raw
        return event


BULK_BYTES = 1024  # smaller chunks hold one event or a few: parsed one by one
_CUT = (b'"finish_reason":"', b'"usage"', b'"error"', b"data: [DONE]", b"\r")


def _plain_prefix(chunk: bytes) -> int:
    """Length of the run of whole events at the start of ``chunk`` before the first one that
    holds a marker of ``_CUT`` (0 when there is none, or just one event)."""
    stop = chunk.rfind(b"\n\n") + 2
    if chunk.find(b"\n\n") + 2 == stop:
        return 0
    for marker in _CUT:
        at = chunk.find(marker, 0, stop)
        if at >= 0:
            stop = chunk.rfind(b"\n\n", 0, at) + 2
            if stop < 2:
                return 0
    return stop


class StreamPluginError(Exception):
    """A ``transform_event`` plugin raised after the stream had started."""

    def __init__(self, plugin: str, exc: BaseException):
        super().__init__(f"{plugin}: {exc}")
        self.error = plugin_failed(plugin, "transform_event", exc)

    def frame(self) -> bytes:
        return data_frame(orjson.dumps(self.error.payload()))


def error_frame(message: str, code: str) -> bytes:
    """The ``error`` event the gateway sends when a stream cannot go on."""
    return data_frame(orjson.dumps({"error": {"message": message, "type": "upstream_error",
                                              "param": None, "code": code}}))
