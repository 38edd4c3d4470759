"""``RequestRecord``: what one request did, gathered on its way, turned into its usage row."""

from __future__ import annotations

import re
import time
from typing import Any

import orjson

from ..call import Call
from ..usage import Usage, estimate_prompt_tokens
from .request_observers import RequestTrace, Tap

_second: list = [None, ""]  # the last whole second formatted, and its text
# The most characters a row keeps of a text that a client or an upstream chose: the model a client
# asked for when it is not in the catalog, a finish reason. PostgreSQL's index on ``model`` refuses
# an entry over 2,704 bytes (the row, and the others of its settlement, would be retried for ever).
MAX_ROW_TEXT = 256


def _utc_now_iso() -> str:
    """Now as ISO-8601 UTC to the millisecond (``2026-11-29T20:00:00.123+00:00``), the
    date and time formatted once a second."""
    now = time.time()
    second = int(now)
    if _second[0] != second:
        _second[0], _second[1] = second, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
    return f"{_second[1]}.{int((now - second) * 1000):03d}+00:00"


class RequestRecord:
    """Filled in by the request path; ``row()`` gives the ``usage_events`` row.

    ``usage`` is what the upstream reported (``None`` if it never did); then
    the completion tokens are the content chunks streamed so far and the prompt
    tokens an estimate from ``body`` — once the request was sent to an upstream
    (``sent``): a client that left before (while queued for a slot, say) cost
    no model server anything.
    """

    __slots__ = ("call", "created_at", "started", "model", "status", "error_code", "usage",
                 "streamed_chunks", "finish_reason", "ttft_ms", "disconnected", "body",
                 "submitted", "committed", "tap", "responded", "hold", "requested_model", "admitted", "trace",
                 "sent", "batch_id")

    def __init__(self, call: Call):
        self.call = call
        self.created_at = _utc_now_iso()
        self.started = time.perf_counter()
        self.model: str | None = None
        self.status = 200
        self.error_code: str | None = None
        self.usage: Usage | None = None
        self.streamed_chunks = 0
        self.finish_reason: str | None = None
        self.ttft_ms: float | None = None
        self.disconnected = False
        self.body: dict | None = None
        self.submitted = False
        self.committed = None  # the ledger's future for this row, once submitted
        self.tap: Tap | None = None  # the inspector's capture of this request, when capture is on
        self.responded = False  # the status line has gone to the client (a stream was prepared)
        self.hold = None  # the in-flight slot and credit hold taken at step 5, until the row is submitted
        self.requested_model: str | None = None  # the catalog id asked for (the model that served may differ)
        self.admitted = 0.0  # loop time of admission (step 5), where request_timeout starts
        self.trace: RequestTrace | None = None  # this request's spans when tracing is on (Gateway.tracer)
        self.sent = False  # the body is with an upstream (``Route.open``; not one that failed): a prompt to pay for
        self.batch_id: str | None = None  # the batch whose line this request runs (the Batch API's runner)

    def fail(self, status: int, code: str | None) -> None:
        self.status = status
        self.error_code = code

    def first_byte(self) -> None:
        if self.ttft_ms is None:
            self.ttft_ms = round((time.perf_counter() - self.started) * 1000, 3)
            if self.trace is not None:
                self.trace.first_token(self.ttft_ms)

    def final_usage(self) -> Usage:
        if self.usage is not None:
            return self.usage
        if self.streamed_chunks == 0 and not (self.disconnected and self.sent):
            return Usage()
        return Usage(estimate_prompt_tokens(self.body), self.streamed_chunks)

    def row(self) -> dict[str, Any]:
        usage = self.final_usage()
        call = self.call
        model = call.model or stored_text(self.model)
        code = self.error_code
        if code is not None:  # an upstream's may be any text
            code = stored_text(code)
        return {
            "id": call.generation_id,
            "created_at": self.created_at,
            "org": call.org,
            "key_id": call.key_id,
            "model": model,
            "endpoint": call.endpoint,
            "stream": int(call.stream),
            "status": self.status,
            "error_code": code,
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "cached_tokens": usage.cached_tokens,
            "total_tokens": usage.total_tokens,
            "cost": usage.cost(call.pricing),
            "duration_ms": round((time.perf_counter() - self.started) * 1000, 3),
            "ttft_ms": self.ttft_ms,
            "finish_reason": _text(self.finish_reason),
            "disconnected": int(self.disconnected),
            "requested_model": self.requested_model or model,
            "upstream": shown_url(call.upstream),
            "batch_id": self.batch_id,
        }


def shown_url(url: str | None) -> str | None:
    """An upstream URL as the row keeps it: as written in the config, its userinfo (``user:pass@``) removed."""
    if url is None or "@" not in url:
        return url
    scheme, sep, rest = url.partition("://")
    end = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    return scheme + sep + rest[:end].rpartition("@")[2] + rest[end:]


def stored_text(text: str | None) -> str | None:
    """``text`` as both stores can keep it: a NUL (which PostgreSQL's text cannot hold: the row
    would never settle) and a lone surrogate (a JSON string may escape one; neither store's text
    holds one, nor does UTF-8) become U+FFFD, and past ``MAX_ROW_TEXT`` characters it is cut, with "…"."""
    if text is None or (len(text) <= MAX_ROW_TEXT and "\x00" not in text and (text.isascii() or _whole(text))):
        return text
    if len(text) > MAX_ROW_TEXT:
        text = text[:MAX_ROW_TEXT - 1] + "…"
    return _SURROGATE.sub("\ufffd", text.replace("\x00", "\ufffd"))


_SURROGATE = re.compile("[\ud800-\udfff]")


def _whole(text: str) -> bool:
    """No lone surrogate: ``text`` is Unicode that UTF-8 can write."""
    return _SURROGATE.search(text) is None


def _text(reason: Any) -> str | None:
    """A finish reason as the client saw it: a string, or the JSON of an odd one (``stored_text``)."""
    if reason is None or (type(reason) is str and len(reason) <= MAX_ROW_TEXT and "\x00" not in reason
                          and (reason.isascii() or _whole(reason))):
        return reason  # nearly always: "stop", "length"
    if type(reason) is not str:
        try:
            reason = orjson.dumps(reason).decode()
        except TypeError:
            reason = str(reason)
    return stored_text(reason)
