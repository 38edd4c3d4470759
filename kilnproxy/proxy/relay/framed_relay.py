"""The streams of the Responses API and Anthropic Messages: ``event:`` + ``data:`` frames, relayed.

Simpler than the completions relay (``plain_relay``), and on purpose separate
from it: these formats name each event (``event:`` lines, which pass through
unchanged), end without ``[DONE]``, and report usage in events of their own
(docs/reference.md, "The other endpoints"):

* Responses: ``response.created`` ... ``response.completed``, whose
  ``response.usage`` is the final count and gets ``cost``; a failure is an
  ``error`` event or ``response.failed``;
* Messages: ``message_start`` (``message.usage``: the prompt counts), then
  ``message_delta`` (``usage``: the output count, and sometimes the prompt's
  again; each count's last report wins, a zero never replacing a count, and
  the last ``message_delta``'s usage gets ``cost``), ``message_stop``; a failure is ``event: error``.

A frame is parsed only when it may carry what the gateway reads or changes
(its format's markers: the model's name, usage, an error, the end), or when
``transform_event`` plugins are loaded; the others (the output deltas) go out
as the upstream's own bytes and are counted, so that a client that leaves
early is billed for what it got. Those are found a chunk at a time, as the
completions relay finds its plain events: each marker searched for once over
the chunk's whole frames, the runs of frames between the marked ones sent as
they came, their deltas counted with one ``count`` a run (their events, for
the number an error event of ours continues, only when that number is asked).
An event orjson refuses but the json module reads (a lone surrogate escape)
is read and written back by the json module (``event_json``), as the
completions relay does.
"""

from __future__ import annotations

import logging
from typing import Any

import orjson

from ...call import DROP, STOP, Call
from ...plugins.manager import Impl
from ...usage import Usage, cap_counts
from .anthropic_errors import STREAM_TYPES, error_type
from .event_json import read, read_stdlib, writable, write
from .event_plugins import event_only
from ..request_record import RequestRecord
from .errors import StreamPluginError

log = logging.getLogger("kilnproxy.plugins")

# The events that carry output, each counted as a token until the final count: on the Responses API every
# ``response.*.delta`` (text, reasoning, a function call's arguments, ...); on Messages every
# ``content_block_delta`` (text, thinking, a tool's input). Inside a JSON string a quote is escaped, so these
# bytes are found only in an event's own ``type``.
DELTAS = {"responses": b'.delta"', "messages": b'"content_block_delta"'}
FINAL = {"responses": ("response.completed", "response.incomplete", "response.failed"), "messages": ("message_stop",)}


UNWRITABLE_CODE = "upstream_bad_response"
UNWRITABLE_MESSAGE = "The upstream sent an event nested deeper than the gateway can write JSON back (254 levels)."
# What marks a frame the gateway reads or changes: the keys (or values) its format's rules read, in quotes (a
# quote inside a JSON string is escaped, so these bytes are a key or a whole string). The Responses API's rules
# read only an event's ``response`` object (its model, usage, status and error: ``response.created`` ...
# ``response.completed``, ``.incomplete``, ``.failed``) and its errors (``"type":"error"``, OpenAI's
# ``{"error": ...}``, vLLM's ``"object":"error"``); Messages' read the model (``message_start``'s message),
# ``usage`` (``message_start``'s and ``message_delta``'s, with its stop reason), errors and ``message_stop``.
MARKERS = {"responses": (b'"response"', b'"error"'),
           "messages": (b'"model"', b'"usage"', b'"error"', b'"message_stop"')}
DATA = b"\ndata:"
LATER = 2048  # a run of plain frames this long or longer has its events counted only when asked (``sequence``)


def _responses_marked(data: bytes) -> bool:
    return b'"response"' in data or b'"error"' in data


def _messages_marked(data: bytes) -> bool:
    return b'"model"' in data or b'"usage"' in data or b'"error"' in data or b'"message_stop"' in data


MARKED = {"responses": _responses_marked, "messages": _messages_marked}


def _first_marked(data: bytes, start: int, size: int, markers: tuple[bytes, ...], ahead: list[int]) -> int:
    """Where the first marker in ``data[start:size]`` is, or -1; ``ahead`` holds each marker's next
    place found so far, and is moved on only for the markers left behind (each scan once)."""
    first = -1
    for i, at in enumerate(ahead):
        if 0 <= at < start:
            at = ahead[i] = data.find(markers[i], start, size)
        if at >= 0 and (first < 0 or at < first):
            first = at
    return first


def _whole(frame: bytes) -> bool:
    """``frame`` (one the upstream's body ended without its blank line) has data, and that data is JSON or
    ``[DONE]``; a comment alone counts too."""
    lines = frame.split(b"\n")
    datas = [line[6:] if line[5:6] == b" " else line[5:] for line in lines if line[:5] == b"data:"]
    if not datas:
        return all(line[:1] == b":" for line in lines)
    payload = b"\n".join(datas)
    if payload.strip() == b"[DONE]":
        return True
    try:
        read(payload)
    except ValueError:
        return False
    return True


class FramedRelay:
    """One stream: ``feed_chunk()`` per upstream chunk, ``close()`` at its end; ``finished`` once the
    format's last event (or an error event) has passed, ``ended`` once nothing more may be relayed."""

    def __init__(self, call: Call, record: RequestRecord, impls: tuple[Impl, ...]):
        self.call = call
        self.record = record
        self.endpoint = call.endpoint
        self.impls = impls
        self.transforms = tuple(event_only(impl, call) for impl in impls)
        self.delta = DELTAS[call.endpoint]
        self.markers = MARKERS[call.endpoint]
        self.marked = MARKED[call.endpoint]
        self.rest = b""
        self.finished = False
        self.ended = False
        self.counts: dict[str, Any] = {}  # Anthropic: each usage field as last reported
        self.events = 0  # events read or counted so far (``sequence``)
        self.uncounted: list[tuple[bytes, int, int]] = []  # runs passed as they came, their events not counted
        self.partial: Usage | None = None  # prompt counts reported before the output's (message_start)

    @property
    def sequence(self) -> int:
        """The events so far: the Responses API numbers its events, and an error event of ours continues
        the count. The long runs of the chunk that holds the format's last event are counted only when
        asked (a stream that comes in one chunk, nginx's in M8, never is); the others with their chunk."""
        if self.uncounted:
            self._count_events()
        return self.events

    def _count_events(self) -> None:
        for data, start, stop in self.uncounted:
            self.events += data.count(DATA, start, stop) + data.startswith(b"data:", start, stop)
        self.uncounted.clear()

    def feed_chunk(self, chunk: bytes) -> bytes:
        if self.uncounted:  # one that came after the last event
            self._count_events()
        data = self.rest + chunk if self.rest else chunk
        if b"\r" in data:
            if data.endswith(b"\r"):  # half a CRLF: wait for the rest
                self.rest = data
                return b""
            data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        end = data.rfind(b"\n\n")
        if end < 0:
            self.rest = data
            return b""
        self.rest = data[end + 2:]
        if self.impls:  # every event is shown to the plugins
            return self._frames(data[:end])
        if not self.rest and end and not self.ended and not self.marked(data):  # whole frames, none marked
            self._plain(data, 0, end)  # (as ``_runs`` would: a model server's chunk of one delta, in fewer steps)
            out = data
        else:
            out = self._runs(data, end)
        if self.uncounted and not self.finished:  # only a stream's last chunk is left to count when asked
            self._count_events()
        return out

    def _runs(self, data: bytes, size: int) -> bytes:
        """``data[:size]``'s frames (a blank line follows them): each run of frames that holds no marker goes
        out as the upstream's bytes, its deltas counted with one ``count``; a frame that holds one is read
        (``_frame``). Each marker is searched for once over the chunk, whatever the number of frames."""
        out = []
        pos = 0
        markers = self.markers
        ahead = [data.find(marker, 0, size) for marker in markers]  # each marker's next place (-1: none left)
        while pos < size and not self.ended:
            marked = _first_marked(data, pos, size, markers, ahead)
            if marked < 0:
                self._plain(data, pos, size)
                out.append(data[pos:size + 2])
                break
            start = data.rfind(b"\n\n", pos, marked)
            start = pos if start < 0 else start + 2
            stop = data.find(b"\n\n", marked, size)
            stop = size if stop < 0 else stop
            if start > pos:
                self._plain(data, pos, start - 2)
                out.append(data[pos:start])
            out.append(self._frames(data[start:stop]))
            pos = stop + 2
        return b"".join(out)

    def _frames(self, block: bytes) -> bytes:
        out = []
        try:
            for frame in block.split(b"\n\n"):
                if self.ended:
                    break
                sent = self._frame(frame.strip(b"\n"))  # a chunk may end in the middle of two blank lines
                if sent:
                    out.append(sent)
        except StreamPluginError as exc:  # the events the plugins let through before it go out first
            exc.before = b"".join(out) + exc.before
            raise
        return b"".join(out)

    def _plain(self, data: bytes, start: int, stop: int) -> None:
        """Count what a run of frames that need no change holds (``data[start:stop]``): its output deltas
        now; its events now when the run is short, else when ``sequence`` is asked."""
        if stop - start < LATER:
            self.events += data.count(DATA, start, stop) + data.startswith(b"data:", start, stop)
        else:
            self.uncounted.append((data, start, stop))
        deltas = data.count(self.delta, start, stop)
        if deltas:
            self.record.streamed_chunks += deltas
            if self.partial is not None:  # until the final count: the output streamed so far
                self.record.usage = Usage(self.partial.prompt_tokens, self.record.streamed_chunks,
                                          self.partial.cached_tokens)

    def close(self) -> bytes:
        """The upstream's body ended: a last frame without its blank line still counts when it is whole (its
        data JSON, or ``[DONE]``); one cut off mid-way is not sent, as a client would fail to parse it."""
        rest, self.rest = self.rest.strip(b"\n"), b""
        if not rest or self.ended or not _whole(rest):
            return b""
        return self._frame(rest)

    def _frame(self, frame: bytes) -> bytes:
        if not frame:
            return b""
        lines = frame.split(b"\n")
        datas = [line[6:] if line[5:6] == b" " else line[5:] for line in lines if line[:5] == b"data:"]
        if not datas:
            return frame + b"\n\n"  # comments pass through
        payload = datas[0] if len(datas) == 1 else b"\n".join(datas)
        self.events += 1
        delta = self.delta in payload  # counted once it is sent (not when a plugin drops it or fails on it)
        if not self.impls and not self.marked(payload):
            return self._sent(frame + b"\n\n", delta)
        try:
            event = orjson.loads(payload)
        except orjson.JSONDecodeError:
            try:
                event = read_stdlib(payload)  # what only the json module reads (a lone surrogate)
            except ValueError:
                return self._sent(frame + b"\n\n", delta)  # not JSON: not ours to judge
        if not isinstance(event, dict):
            return self._sent(frame + b"\n\n", delta)
        if (event.get("error") is not None or event.get("object") == "error") and event.get("type") != "error":
            return self._openai_error(event)
        self._read(event)
        if self.impls:
            verdict = self._transform(event)
            if verdict is DROP:
                return b""
            if verdict is STOP:
                self.ended = True
        try:
            data = orjson.dumps(event)
        except TypeError:  # what only the json module writes (a lone surrogate), else not JSON
            data = self._written(event, payload)
            if data is None:
                return self._unwritable()
        kept = [line for line in lines if line[:5] != b"data:"]
        if self.ended and event.get("type") == "error" and not any(line[:6] == b"event:" for line in kept):
            kept.insert(0, b"event: error")  # the Anthropic SDK reads an error only from a frame named so
        out = b"\n".join(kept + [b"data: " + data]) + b"\n\n"
        return self._sent(out, True) if delta else out

    def _written(self, event: dict, payload: bytes) -> bytes | None:
        """``event`` written by the json module (``event_json``); None when the upstream's event itself
        cannot be written back (nested too deep: its fault, whatever plugins saw it); a plugin's
        ``StreamPluginError`` when its change made the event no longer JSON."""
        try:
            return write(event)
        except TypeError as exc:
            if not self.impls or not writable(payload):
                return None
            names = ", ".join(impl.plugin for impl in self.impls)
            raise StreamPluginError(names, TypeError(f"the event is no longer JSON: {exc}")) from exc

    def _sent(self, out: bytes, delta: bool) -> bytes:
        """``out``, an event going to the client; a delta counted as a token of output."""
        if delta:
            self.record.streamed_chunks += 1
            if self.partial is not None:  # until the final count: the output streamed so far
                self.record.usage = Usage(self.partial.prompt_tokens, self.record.streamed_chunks,
                                          self.partial.cached_tokens)
        return out

    def _openai_error(self, event: dict) -> bytes:
        """An upstream error in OpenAI's form (``{"error": {...}}``, or vLLM's older flat object), which
        neither format's clients read as an error (the Anthropic SDK skips a frame with no ``event:``): told
        as the format's own error event, which ends the stream. Its code as the completion endpoints take
        it (a string ``code``, else ``upstream_error``); on Messages, its type by a numeric code as a
        status would give it."""
        error = event.get("error", event) if event.get("object") != "error" else event
        if not isinstance(error, dict):
            error = {"message": error}
        code, message = error.get("code"), error.get("message")
        if not isinstance(message, str):
            message = "The upstream failed." if message is None else write(message).decode("utf-8", "replace")
        self.record.error_code = code if isinstance(code, str) else "upstream_error"
        self.ended = self.finished = True
        if self.endpoint == "responses":
            param = error.get("param")
            data = {"type": "error", "code": self.record.error_code, "message": message,
                    "param": param if isinstance(param, str) else None, "sequence_number": self.sequence - 1}
        else:
            kind = error_type(code) if type(code) is int and 400 <= code <= 599 else "api_error"
            data = {"type": "error", "error": {"type": kind, "message": message}}
        return b"event: error\ndata: " + write(data) + b"\n\n"  # write: the message may hold a lone surrogate

    def _unwritable(self) -> bytes:
        """The error event that ends the stream when the upstream sent an event the gateway cannot write
        back (nested deeper than 254 levels, as a JSON answer may not be): the upstream's fault, whatever
        plugins saw the event. The rest of its answer is not read."""
        self.record.error_code = UNWRITABLE_CODE
        self.ended = True
        return self.error_frame(UNWRITABLE_MESSAGE, UNWRITABLE_CODE)

    def _read(self, event: dict) -> None:
        """What the gateway takes from an event, and changes in it (model, usage's cost)."""
        kind = event.get("type")
        record = self.record
        if kind == "error":
            nested = event.get("error")
            if isinstance(nested, dict):  # Anthropic's {"type": "error", "error": {"type", "message"}}
                code = nested.get("code") or nested.get("type")
            else:  # the Responses API's {"type": "error", "code", "message", ...}: its code may be null
                code = event.get("code")
            record.error_code = code if isinstance(code, str) else "upstream_error"
            self.ended = self.finished = True
            return
        if self.endpoint == "responses":
            response = event.get("response")
            if isinstance(response, dict):
                if "model" in response:
                    response["model"] = self.call.model
                usage = response.get("usage")
                if isinstance(usage, dict):
                    cap_counts(usage)
                    record.usage = Usage.of_endpoint("responses", usage)
                    usage["cost"] = record.usage.cost(self.call.pricing)
                if kind in FINAL["responses"]:
                    record.finish_reason = response.get("status")
                    self.finished = True
                if kind == "response.failed":
                    error = response.get("error")
                    code = error.get("code") if isinstance(error, dict) else None
                    record.error_code = code if isinstance(code, str) else "upstream_error"
            return
        message = event.get("message")
        if isinstance(message, dict) and "model" in message:
            message["model"] = self.call.model
        usage = event.get("usage", message.get("usage") if isinstance(message, dict) else None)
        if isinstance(usage, dict):
            cap_counts(usage)
            reported = self.counts  # each count's last report wins, but a zero never replaces a count
            reported.update((k, v) for k, v in usage.items() if type(v) is int and (v or not reported.get(k)))
            counts = Usage.of_endpoint("messages", reported)
            if kind == "message_delta":
                record.usage, self.partial = counts, None
                usage["cost"] = counts.cost(self.call.pricing)
            else:
                self.partial = counts
                record.usage = Usage(counts.prompt_tokens, record.streamed_chunks, counts.cached_tokens)
        delta = event.get("delta")
        if kind == "message_delta" and isinstance(delta, dict) and delta.get("stop_reason"):
            record.finish_reason = delta["stop_reason"]
        if kind == "message_stop":
            self.finished = True

    def _transform(self, event: dict) -> Any:
        verdict = None
        for impl, function in zip(self.impls, self.transforms):
            try:
                result = function(event)
            except BaseException as exc:
                log.error("plugin %r raised in transform_event", impl.plugin, exc_info=exc)
                raise StreamPluginError(impl.plugin, exc) from exc
            if result is STOP or result is DROP:
                verdict = result if verdict is None else verdict
        return verdict

    def error_frame(self, message: str, code: str) -> bytes:
        """The format's own error event, for a stream the gateway cannot finish."""
        if self.endpoint == "responses":
            data = {"type": "error", "code": code, "message": message, "param": None,
                    "sequence_number": self.sequence}
        else:
            data = {"type": "error", "error": {"type": STREAM_TYPES.get(code, "api_error"), "message": message}}
        return b"event: error\ndata: " + orjson.dumps(data) + b"\n\n"
