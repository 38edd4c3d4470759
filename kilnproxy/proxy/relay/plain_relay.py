"""The streamed response: upstream SSE -> the response rules (docs/reference.md) -> plugins -> client.

``EventRelay`` decides what the client gets, a chunk at a time. The whole
events of a chunk are checked together by ``PlainRun`` (``plain_events.py``) with a
handful of bytes operations; when no rule changes any of them they go out as
the upstream's own bytes, the model's name replaced. The last events of a
chunk, where a stream's finish reason, usage and ``[DONE]`` are, are set apart
(from the chunk's one split at the blank lines, ``_split_run``) and read one by
one, with the same substring tests per event (``find``: a bytes ``in`` tries its
operand as an int first, a raised error's cost). The model's
name is the event's own ``model``, never one of an object nested in it; where
the bytes do not show which is the event's own (``plain_events``: ``TOP``) the
event is parsed. An event is parsed only then, when it carries usage, an error
or a finish reason, names the model differently, or when a ``transform_event``
plugin is loaded (then each event is parsed once, shown to the plugins and
serialised once). What orjson refuses but is JSON (a lone surrogate escape) is
read and written by the json module (``event_json``); what is not JSON goes
out as it came. An event the gateway cannot write back (nested deeper than
254 levels) ends the stream with an ``upstream_bad_response`` error event,
whoever saw it; a plugin that leaves the event no longer JSON is a plugin error
(naming every ``transform_event`` plugin when several saw the event).

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
from functools import partial
from types import MethodType
from typing import Any, Callable

import orjson

from ...call import DROP, STOP, Call
from ...plugins.manager import Impl, call_impl
from ...sse import COMMENT, DATA, DONE_FRAME, SSEParser, data_frame, is_done, lines_frame
from ...usage import Usage
from .event_json import read_stdlib, writable, write
from .plain_scanner import (ERROR, EVENT_SEP, FINISH, FINISH_NULL, MODEL_KEY, ROLE, USAGE, USAGE_NULL, PlainRun,
                           closes_top, opens_top)
from ..request_record import RequestRecord
from .errors import StreamPluginError
from ..upstream.routes import Route
from .usage_chunk import usage_chunk

log = logging.getLogger("kilnproxy.plugins")


class EventRelay:
    """One stream's relay: ``feed_chunk()`` for each chunk the upstream sends, ``close()`` at its
    end of body, ``tail()`` for what follows the last event."""

    __slots__ = ("call", "route", "record", "impls", "transforms", "parse_all", "rename", "catalog_key",
                 "upstream_key", "own_start", "own_end", "own_end_key", "ended", "error",
                 "usage_raw", "raw_counts", "usage_event", "last_event", "clean_end", "parser", "rest", "plain", "by_parser", "crlf",
                 "choice_usage", "request_usage", "chat", "several",
                 "finished_choices")

    def __init__(self, call: Call, route: Route, record: RequestRecord, impls: tuple[Impl, ...]):
        self.call = call
        self.route = route
        self.record = record
        self.impls = impls
        self.parse_all = bool(impls)
        self.transforms = tuple([_event_only(impl, call) for impl in impls]) if impls else ()
        self.catalog_key, self.upstream_key = route.model_bytes, route.upstream_model_bytes  # b'"model":"<name>"'
        self.rename = self.catalog_key != self.upstream_key
        # the bytes of an event that showed its own model to be the upstream's name (``_own_model``), from its
        # start or from the byte before the key to its end: a stream's events share them (none, at first)
        self.own_start = self.own_end = b"\0"
        self.own_end_key = 0
        self.chat = call.endpoint == "chat/completions"  # a text completion's chunk names no role: not looked for
        self.ended = False  # [DONE], an error event, or a plugin's STOP: read no further
        self.error: bytes | None = None
        self.usage_raw: dict | None = None
        self.raw_counts: Usage | None = None  # usage_raw's counts
        self.usage_event: dict | None = None
        self.last_event: dict | None = None
        self.clean_end = False  # the upstream finished its answer ([DONE], an error event): read it to its end
        self.parser = SSEParser()
        self.rest: list[bytes] = []  # the start of an event whose blank line has not come yet
        self.plain = PlainRun(route.upstream_model_bytes, route.model_bytes)
        self.by_parser = False  # the parser is inside an event, or a CR was seen: it takes every chunk
        self.crlf = False  # a CR was seen: the parser for good
        self.choice_usage: dict[Any, Usage] = {}  # the latest report on each choice's chunks, by index
        self.request_usage: list[Usage] = []  # the reports of choices: [] chunks
        n = record.body.get("n") if isinstance(record.body, dict) else None
        self.several = type(n) is int and n > 1  # several choices: their reports are added up
        self.finished_choices: set = set()  # the indexes of the choices that had their finish reason

    # -- per chunk ----------------------------------------------------------

    def feed_chunk(self, chunk: bytes) -> bytes:
        """The bytes to send for this chunk of the upstream's body (possibly none).

        The same bytes, and the same record, as ``feed(parser.feed(chunk))`` chunk after
        chunk (tests/test_relay_chunks.py compares both on random cuts), sooner: the
        whole events of a chunk are taken together. When ``PlainRun`` finds that none
        of them needs a change they go out as they came, renamed by one ``replace``;
        else the last few events, where a stream's finish reason, usage and
        ``[DONE]`` are, are set apart and only they are read one by one. The
        unfinished event at the end of a chunk waits in ``rest`` for its blank line,
        so the parser is always between events and can take over at any chunk.
        """
        if self.by_parser:
            out = self.feed(self.parser.feed(chunk))
            self.by_parser = self.crlf or not self.parser.idle()
            return out
        rest = self.rest
        if rest:
            rest.append(chunk)
            if LF not in chunk and CR not in chunk:
                return b""
            chunk = b"".join(rest)
            rest.clear()
        if CR in chunk:  # CR or CRLF line ends: the parser's business
            self.by_parser = self.crlf = True
            return self.feed(self.parser.feed(chunk))
        end = chunk.rfind(b"\n\n") + 2
        if end < 2:
            end = 0
        if end < len(chunk):
            tail = chunk[end:]
            if tail[:1] == b":" or tail.find(b"\n:") >= 0:  # a comment goes out when its line ends: the parser's way
                out = self._events(chunk[:end]) if end else b""
                if self.ended:
                    return out
                self.by_parser = True
                return _then(out, self.feed_chunk, tail)
            if not end:
                rest.append(chunk)
                return b""
            rest.append(tail)
            chunk = chunk[:end]
        if chunk.find(b"\n") == len(chunk) - 2 and chunk[:6] == b"data: ":
            return self.feed_data([chunk[6:-2]])  # one data line: a model server's token, as the parser reads it
        if self.parse_all:
            return self._plugged_events(chunk)
        if chunk[:7] == b"data: {":
            return self._split_run(chunk)
        return self._cut_run(chunk)

    def close(self) -> bytes:
        """The upstream's body has ended: what is left, and a last event with no blank line when it is
        whole (``[DONE]`` or JSON); one cut off by the end of the body is not sent."""
        items = self.parser.feed(b"".join(self.rest)) if self.rest else []
        self.rest.clear()
        last = self.parser.close()
        if last and last[-1][0] == DATA and not _whole(last[-1][1]):
            last.pop()
        return self.feed(items + last)

    def _split_run(self, chunk: bytes) -> bytes:
        """``feed_chunk``'s whole events (``chunk``, opening with ``data: {``) split once at the blank
        lines: the last few that carry a marker (``_marked``, as ``_tail_start`` sets them apart) read one
        by one, those before checked together by ``PlainRun``. Else as ``_tail_start`` cuts the chunk
        (an event of several lines among the last ones)."""
        events = chunk[6:-2].split(EVENT_SEP)
        k = len(events)
        last = max(k - TAIL_EVENTS, 1)  # the first event is never set apart (``_tail_start``)
        while k > last and _marked(events[k - 1]):
            k -= 1
        if k == len(events):
            tail = None
            end = len(chunk)
        else:
            tail = events[k:]
            for payload in tail:
                if LF in payload:  # not a one-line event: the blank lines cut the chunk elsewhere
                    return self._cut_run(chunk)
            del events[k:]
            end = len(chunk) - sum(map(len, tail)) - 8 * len(tail)
        n, out, roles = self.plain.take_split(chunk, end, events, tail and partial(self._feed_marked, tail))
        if not n:
            return self._events(chunk)
        self.record.streamed_chunks += n - _role_only_count(events) if roles and self.chat else n
        return out

    def _cut_run(self, chunk: bytes) -> bytes:
        """``feed_chunk``'s whole events, cut by ``_tail_start``."""
        cut = self._tail_start(chunk)
        if cut:
            head = chunk if cut == len(chunk) else chunk[:cut]
            n, out, roles = self.plain.take(head)
            if n:  # n events unchanged (renamed), counted as ``_event`` counts them
                self.record.streamed_chunks += n - _role_only_events(head) if roles and self.chat else n
                return out if head is chunk else _then(out, self._events, chunk[cut:])
        return self._events(chunk)

    def _tail_start(self, events: bytes) -> int:
        """Where the last events begin that carry a marker (at most ``TAIL_EVENTS`` of them; the
        whole length when the last one carries none). Only a guess of where to cut: what comes
        before is then checked by ``PlainRun`` like any run."""
        cut = len(events)
        for _ in range(TAIL_EVENTS):
            start = events.rfind(b"\n\n", 0, cut - 2) + 2
            if start < 2:
                return cut
            event = events[start:cut]  # marked: [DONE], an error, usage or a finish reason (what ends or is read)
            find = event.find  # find, not ``in``: a bytes ``in`` first tries its operand as an int, an exception
            if not (event[:12] == DONE_LINE or find(ERROR) >= 0 or find(USAGE) >= 0 and find(USAGE_NULL) < 0
                    or find(FINISH) >= 0 and find(FINISH_NULL) < 0):
                return cut
            cut = start
        return cut

    def _events(self, events: bytes) -> bytes:
        """Whole events one by one: split at C speed when each is one ``data:`` line, else parsed."""
        if events[:6] == b"data: ":
            payloads = events[6:-2].split(b"\n\ndata: ")
            if events.count(b"\n") == 2 * len(payloads):  # no other line: each is one data line
                return self._plugged_data(payloads) if self.parse_all else self.feed_data(payloads)
        return self.feed(self.parser.feed(events))

    # -- per event ----------------------------------------------------------

    def feed(self, items: list[tuple[int, bytes]]) -> bytes:
        """The bytes to send for these parsed SSE items (possibly none)."""
        out = []
        try:
            for kind, payload in items:
                if kind == COMMENT:
                    out.append(payload + b"\n\n")
                    continue
                if is_done(payload):
                    self.ended = self.clean_end = True
                    break
                frame = self._event(payload)
                if frame is not None:
                    out.append(frame if LF not in payload else lines_frame(frame))
                if self.ended:
                    break
        except StreamPluginError as exc:
            exc.before = b"".join(out) + exc.before
            raise
        return b"".join(out)

    def feed_data(self, payloads: list[bytes]) -> bytes:
        """``feed`` for events that are all data (no comment)."""
        out = []
        try:
            for payload in payloads:
                if is_done(payload):
                    self.ended = self.clean_end = True
                    break
                frame = self._event(payload)
                if frame is not None:
                    out.append(frame)
                if self.ended:
                    break
        except StreamPluginError as exc:
            exc.before = b"".join(out) + exc.before
            raise
        return b"".join(out)

    def _feed_marked(self, payloads: list[bytes]) -> bytes:
        """``feed_data`` for one-line events that ``_marked`` set apart (no plugin loaded): each is
        ``[DONE]`` or fails ``_event``'s tests of an event sent as it came (an error, usage that is not
        null, a finish reason that is not null), so it is parsed without them."""
        out = []
        for payload in payloads:
            if is_done(payload):
                self.ended = self.clean_end = True
                break
            frame = self._parsed_event(payload)
            if frame is not None:
                out.append(frame)
            if self.ended:
                break
        return b"".join(out)

    def _event(self, payload: bytes) -> bytes | None:
        if self.parse_all:
            data = self._plugged(payload)
            return None if data is None else data_frame(data)
        find = payload.find
        finish = find(FINISH)  # none, or one and null (several: another choice's may be a reason)
        if ((find(USAGE) < 0 or find(USAGE_NULL) >= 0)
                and find(ERROR) < 0
                and (finish < 0 or payload.startswith(FINISH_NULL, finish)
                     and payload.find(FINISH, finish + FINISH_LEN) < 0)):
            if payload.startswith(self.own_start) or (payload.endswith(self.own_end)
                                                      and payload.find(MODEL_KEY) == len(payload) - self.own_end_key):
                renamed = self.rename  # the bytes that showed the event before it its own model show this one's
            else:
                renamed = self._own_model(payload)
                if renamed is None:
                    return self._parsed_event(payload)
            self.record.streamed_chunks += not self.chat or find(ROLE) < 0 or not _role_only(payload)
            # the event's own model is its first "model": (TOP), so replace's
            return data_frame(payload.replace(self.upstream_key, self.catalog_key, 1) if renamed else payload)
        return self._parsed_event(payload)

    def _own_model(self, payload: bytes) -> bool | None:
        """Whether the event's first ``"model":`` is its own (not a key of an object nested in it), shown by
        a few bytes (plain_events: ``TOP``), and names the upstream's model (True: to rename) or the catalog
        id (False); None when that is not shown (the event is parsed). The bytes that showed the upstream's
        name are kept: the next events that share them need no other test."""
        at = payload.find(MODEL_KEY)
        start = opens_top(payload, at)  # vLLM, SGLang, Ollama: before any object opens
        if not start and not closes_top(payload, at):  # llama.cpp: after its choices close
            return None
        if payload.startswith(self.upstream_key, at):
            if start:
                self.own_start = payload[:at + len(self.upstream_key)]
            else:
                self.own_end, self.own_end_key = payload[at - 1:], len(payload) - at
            return self.rename
        if payload.startswith(self.catalog_key, at):
            return False
        return None

    def _parsed_event(self, payload: bytes) -> bytes | None:
        """An event that carries usage, an error or a finish reason, or whose model is not shown by its
        bytes (no plugin loaded)."""
        try:
            event = orjson.loads(payload)
        except orjson.JSONDecodeError:
            try:
                event = read_stdlib(payload)  # what only the json module reads (a lone surrogate)
            except ValueError:
                return data_frame(payload)  # not JSON: not ours to judge; the client sees what was sent
        if not isinstance(event, dict):
            return data_frame(payload)
        if event.get("error") is not None or event.get("object") == "error":
            return data_frame(self._upstream_error(event))
        choices = event.get("choices")
        if event.get("usage") is not None and self._usage_taken(event, choices):
            return None
        if choices:
            self.record.streamed_chunks += not self.chat or ROLE not in payload or not _role_only(payload)
        if "model" in event:
            event["model"] = self.call.model
        self.last_event = event
        try:
            data = orjson.dumps(event)  # ``write``'s first step, in line
        except TypeError:
            try:
                data = write(event)  # what only the json module writes (a lone surrogate)
            except TypeError:  # no plugin changed it: the upstream's event is beyond what the gateway writes
                return data_frame(self._unwritable())
        if isinstance(choices, list):  # _take_finish_reason, in line: what the client sees
            for choice in choices:
                if isinstance(choice, dict):
                    reason = choice.get("finish_reason")
                    if reason:
                        self.record.finish_reason = reason
                        self._choice_finished(choice)
        return b"data: " + data + b"\n\n"

    def _plugged_events(self, events: bytes) -> bytes:
        """``_events`` with ``transform_event`` plugins. Each event is one ``data:`` line (a model
        server's, nginx's) when the events' data, split at the blank lines, holds no line end:
        one join and one ``memchr`` (0.7 µs on M3's 13 KB), where ``_events`` counts the line ends
        (``bytes.count`` of one byte walks the chunk a byte at a time: 7 µs, as long as parsing
        and writing seven of its events)."""
        if events[:6] == b"data: ":
            payloads = events[6:-2].split(b"\n\ndata: ")
            if b"\n" not in b"".join(payloads):
                return self._plugged_data(payloads)
        return self.feed(self.parser.feed(events))

    def _plugged_data(self, payloads: list[bytes]) -> bytes:
        """``feed_data`` with ``transform_event`` plugins: the frames put together once. With one
        plugin, a stream's usual event (an object with no usage object and no ``error`` key) is
        taken here in line, the same steps as ``_plugged_event`` without its calls: this loop is
        the cost of every event of every stream that has a plugin. The chunks it counts go to
        the record once."""
        if len(self.transforms) != 1:
            return self._plugged_each(payloads)
        out: list[bytes] = []
        append = out.append
        one = self.transforms[0]
        model, record, chat, loads, dumps = self.call.model, self.record, self.chat, orjson.loads, orjson.dumps
        counted = 0
        try:
            for payload in payloads:
                try:
                    event = loads(payload)
                except orjson.JSONDecodeError:  # [DONE] is not JSON: looked for only here
                    if is_done(payload):
                        self.ended = self.clean_end = True
                        break
                    data = self._plugged_stdlib(payload)
                    if data is not None:
                        append(data)
                    if self.ended:
                        break
                    continue
                if type(event) is not dict or "error" in event or event.get("usage") is not None \
                        or event.get("object") == "error":
                    data = self._plugged_event(event, payload)
                    if data is not None:
                        append(data)
                    if self.ended:
                        break
                    continue
                if event.get("choices") and (not chat or ROLE not in payload or not _role_only(payload)):
                    counted += 1
                if "model" in event:
                    event["model"] = model
                self.last_event = event
                try:
                    verdict = one(event)
                except BaseException as exc:
                    raise self._failed(self.impls[0], exc) from exc
                if verdict is not None:
                    if verdict is DROP:
                        self._dropped(event)
                        continue
                    if verdict is STOP:
                        self.ended = True
                try:
                    append(dumps(event))
                except TypeError:
                    append(self._written(event, payload))
                    if self.error is not None:  # the upstream's event could not be written back
                        break
                choices = event.get("choices")
                if isinstance(choices, list):  # _take_finish_reason, in line
                    for choice in choices:
                        if isinstance(choice, dict):
                            reason = choice.get("finish_reason")
                            if reason:
                                record.finish_reason = reason
                                self._choice_finished(choice)
                if verdict is STOP:  # nothing else in line ends the stream (an unwritable event breaks above)
                    break
        except StreamPluginError as exc:
            exc.before = _frames(out) + exc.before
            raise
        finally:
            record.streamed_chunks += counted
        return _frames(out)

    def _plugged_each(self, payloads: list[bytes]) -> bytes:
        """``_plugged_data`` with several plugins: each event as it is when it comes alone."""
        out = []
        try:
            for payload in payloads:
                try:
                    event = orjson.loads(payload)
                except orjson.JSONDecodeError:
                    if is_done(payload):
                        self.ended = self.clean_end = True
                        break
                    data = self._plugged_stdlib(payload)
                else:
                    data = self._plugged_event(event, payload)
                if data is not None:
                    out.append(data)
                if self.ended:
                    break
        except StreamPluginError as exc:
            exc.before = _frames(out) + exc.before
            raise
        return _frames(out)

    def _plugged(self, payload: bytes) -> bytes | None:
        """With plugins, every event: one parse, the rules, the plugins, one serialisation; the
        event's new data, or None when it is dropped."""
        try:
            event = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return self._plugged_stdlib(payload)
        return self._plugged_event(event, payload)

    def _plugged_stdlib(self, payload: bytes) -> bytes | None:
        """``_plugged`` for an event orjson refused: read by the json module (a lone surrogate), else not
        JSON, sent as it came (the plugins see only JSON)."""
        try:
            event = read_stdlib(payload)
        except ValueError:
            return payload
        return self._plugged_event(event, payload)

    def _plugged_event(self, event: Any, payload: bytes) -> bytes | None:
        """``_plugged`` once ``payload`` is parsed into ``event``. ``_plugged_data`` repeats these steps in
        line for a stream's usual event: a rule changed here changes there (tests/test_relay_chunks.py
        compares the two on every odd stream)."""
        if not isinstance(event, dict):
            return payload
        if event.get("error") is not None or event.get("object") == "error":
            return self._upstream_error(event)
        choices = event.get("choices")
        if event.get("usage") is not None and self._usage_taken(event, choices):
            return None
        if choices:
            self.record.streamed_chunks += not self.chat or ROLE not in payload or not _role_only(payload)
        if "model" in event:
            event["model"] = self.call.model
        self.last_event = event
        if len(self.transforms) == 1:  # the usual case, without the loop
            try:
                verdict = self.transforms[0](event)
            except BaseException as exc:
                raise self._failed(self.impls[0], exc) from exc
        else:
            verdict = self._transform(event, payload)
        if verdict is DROP:
            self._dropped(event)
            return None
        if verdict is STOP:
            self.ended = True
        try:
            data = orjson.dumps(event)
        except TypeError:
            data = self._written(event, payload)
            if self.error is not None:  # the upstream's event could not be written back
                return data
        choices = event.get("choices")
        if choices:
            self._take_finish_reason(choices)  # what the client sees
        return data

    def _dropped(self, event: dict) -> None:
        """A plugin left ``event`` out: its finish reason, which the client does not see, still says
        the upstream finished that choice (``answered``)."""
        choices = event.get("choices")
        if isinstance(choices, list):
            for choice in choices:
                if isinstance(choice, dict) and choice.get("finish_reason"):
                    self._choice_finished(choice)

    def _take_finish_reason(self, choices: Any) -> None:
        if not isinstance(choices, list):  # not OpenAI's form: no finish reason to read
            return
        for choice in choices:
            reason = choice.get("finish_reason") if isinstance(choice, dict) else None
            if reason:
                self.record.finish_reason = reason
                self._choice_finished(choice)

    def _choice_finished(self, choice: dict) -> None:
        index = choice.get("index")
        self.finished_choices.add(index if type(index) is int else 0)

    def _usage_taken(self, event: dict, choices: Any) -> bool:
        """An event with a ``usage`` that is not null: its counts read (an object), the usage removed from
        the event; True when nothing else is left to send (no choices)."""
        usage = event["usage"]
        if isinstance(usage, dict):
            self._take_usage(usage, choices)
            if not choices:
                self.usage_event = event
        if not choices:
            return True
        event["usage"] = None
        return False

    def _take_usage(self, usage: dict, choices: Any) -> None:
        counts = Usage.from_upstream(usage)
        if counts.is_zero():  # Ollama's placeholder zeros: not a report
            return
        self.usage_raw, self.raw_counts = usage, counts
        if not self.several:  # one choice: the latest report replaces the one before (combined: itself)
            self.request_usage = [counts]
            self.record.usage = counts
            return
        if isinstance(choices, list) and choices:  # on a choice's chunk: that choice's latest count
            index = choices[0].get("index") if isinstance(choices[0], dict) else None
            self.choice_usage[index if type(index) is int else 0] = counts
        else:  # a choices: [] chunk: the whole request's (vLLM), or one choice's of several (llama.cpp chat)
            self.request_usage.append(counts)
        self.record.usage = Usage.combined(self.request_usage or list(self.choice_usage.values()))

    def _upstream_error(self, event: dict) -> bytes:
        """The error event's data (in OpenAI's form); the stream ends with it."""
        if event.get("error") is None:  # vLLM before 0.10.1: a flat error object
            event = {"error": {k: v for k, v in event.items() if k not in ("object", "error")}}
        elif not isinstance(event["error"], dict):  # a bare message: put in OpenAI's form
            message = event["error"]
            event = {"error": {"message": message if isinstance(message, str) else orjson.dumps(message).decode(),
                               "type": "upstream_error", "param": None, "code": "upstream_error"}}
        error = event["error"]
        code = error.get("code") if isinstance(error, dict) else None
        self.record.error_code = code if isinstance(code, str) else "upstream_error"
        try:
            data = write(event)
        except TypeError:
            return self._unwritable()
        self.error = data_frame(data)
        self.ended = self.clean_end = True
        return data

    def _unwritable(self) -> bytes:
        """The data of the error event that ends the stream when the upstream sent an event the gateway
        cannot write back (nested deeper than 254 levels, as a JSON answer may not be): the upstream's
        fault, whatever plugins saw the event. The rest of its answer is not read."""
        self.record.error_code = "upstream_bad_response"
        self.error = data_frame(UNWRITABLE)
        self.ended = True
        return UNWRITABLE

    def _transform(self, event: dict, payload: bytes | None) -> Any:
        """Several plugins in turn on ``event``; the first DROP or STOP wins."""
        verdict = None
        for impl, function in zip(self.impls, self.transforms):
            try:
                result = function(event)
            except BaseException as exc:
                raise self._failed(impl, exc) from exc
            if result is STOP or result is DROP:
                verdict = result if verdict is None else verdict
        return verdict

    def _written(self, event: dict, payload: bytes | None) -> bytes:
        """``event``'s data once the plugins changed it, when orjson did not write it: the json module's
        (a lone surrogate); else, when the upstream's event (``payload``) cannot be written back either,
        the error event that ends the stream (``_unwritable``), no plugin's fault; else the plugins'
        error: the one plugin, or every ``transform_event`` plugin when several saw the event (telling
        which would cost a check of the event after each plugin, on every event of every stream)."""
        try:
            return write(event)
        except TypeError as exc:
            if payload is not None and not writable(payload):
                return self._unwritable()
            names = ", ".join(impl.plugin for impl in self.impls)
            raise StreamPluginError(names, TypeError(f"the event is no longer JSON: {exc}")) from exc

    @staticmethod
    def _failed(impl: Impl, exc: BaseException) -> "StreamPluginError":
        """The stream's error for ``exc``, whatever it is: a plugin's ``KeyboardInterrupt`` or
        ``CancelledError`` too (a plain function runs to its end: no cancellation reaches it)."""
        log.error("plugin %r raised in transform_event", impl.plugin, exc_info=exc)
        return StreamPluginError(impl.plugin, exc)

    # -- the end --------------------------------------------------------------

    def answered(self) -> bool:
        """Every choice the request asked for (``n``, else one) has had its finish reason, whether the
        client saw it or a plugin dropped its event: the answer is whole, though ``[DONE]`` (and perhaps
        the usage chunk) may not have come."""
        n = self.record.body.get("n") if isinstance(self.record.body, dict) else None
        return len(self.finished_choices) >= (n if type(n) is int and n > 1 else 1)

    def tail(self) -> bytes:
        """What follows the last event: the usage chunk if asked for, then ``[DONE]``."""
        if self.error is not None or not self.call.include_usage:
            return DONE_FRAME
        event = usage_chunk(self.call, self.record.final_usage(), self.usage_event, self.last_event, self.usage_raw,
                            self.raw_counts)
        try:
            data = write(event)  # also before the plugins: a fault writing it after them is theirs
        except TypeError:  # the upstream's usage object, nested too deep
            return data_frame(self._unwritable()) + DONE_FRAME
        if not self.parse_all:
            return data_frame(data) + DONE_FRAME
        try:
            if self._transform(event, None) is DROP:
                return DONE_FRAME
            return data_frame(self._written(event, None)) + DONE_FRAME
        except StreamPluginError as exc:
            self.record.error_code = exc.error.code
            return exc.frame() + DONE_FRAME


UNWRITABLE = orjson.dumps({"error": {
    "message": "The upstream sent an event nested deeper than the gateway can write JSON back (254 levels).",
    "type": "upstream_error", "param": None, "code": "upstream_bad_response"}})

# The finish chunk, the usage chunk and [DONE] end a stream: a chunk's last events are looked
# at one by one before the rest is checked as a whole.
TAIL_EVENTS = 4
DONE_LINE = b"data: [DONE]"
LF, CR = 10, 13  # ``10 in data`` is a memchr; ``b"\n" in data`` tries b"\n" as an int first, a raised error's cost


FINISH_LEN = len(FINISH)
TOOL_CALLS = b'"tool_calls"'
CONTENT, EMPTY_CONTENT = b'content":"', b'content":""'  # also reasoning_content


def _role_only(payload: bytes) -> bool:
    """A chat chunk that names the role (callers look for ``ROLE`` first) and carries no text and no tool
    call: the chunk before the answer, not counted as a streamed token."""
    return TOOL_CALLS not in payload and CONTENT not in payload.replace(EMPTY_CONTENT, b"")


def _role_only_events(events: bytes) -> int:
    """How many of ``events`` (whole one-line ``data:`` events, some naming the role) are ``_role_only``."""
    return sum(1 for payload in events[6:-2].split(b"\n\ndata: ") if ROLE in payload and _role_only(payload))


def _role_only_count(payloads: list[bytes]) -> int:
    """How many of ``payloads`` (one-line events, some naming the role) are ``_role_only``."""
    return sum(1 for payload in payloads if payload.find(ROLE) >= 0 and _role_only(payload))


def _marked(payload: bytes) -> bool:
    """A one-line event ``_tail_start`` sets apart: ``[DONE]``, an error, usage or a finish reason (what
    ends the stream or is read). ``find``, not ``in``: a bytes ``in`` tries its operand as an int first."""
    find = payload.find
    return (payload[:6] == b"[DONE]" or find(ERROR) >= 0 or find(USAGE) >= 0 and find(USAGE_NULL) < 0
            or find(FINISH) >= 0 and find(FINISH_NULL) < 0)


def _whole(payload: bytes) -> bool:
    """A last event the body's end closed, not cut: ``[DONE]`` or JSON."""
    if is_done(payload):
        return True
    try:
        orjson.loads(payload)
    except orjson.JSONDecodeError:
        try:
            read_stdlib(payload)
        except ValueError:
            return False
    return True


def _then(out: bytes, more: Callable[[Any], bytes], events: Any) -> bytes:
    """``out`` + ``more(events)``; ``out`` also goes ahead of a plugin's error raised by ``more``."""
    try:
        return out + more(events)
    except StreamPluginError as exc:
        exc.before = out + exc.before
        raise


def _event_only(impl: Impl, call: Call) -> Callable[[dict], Any]:
    """A ``transform_event`` implementation as a function of the event alone, its ``call`` bound
    once per stream (pluggy passes arguments by name; these are its names in order). ``call``
    first is bound as a method's ``self`` is: the interpreter calls a bound method of a
    function as the function itself, in the caller's loop, where a ``partial`` is a C call."""
    function, names = impl.function, impl.argnames
    if names == ("event",):
        return function
    if names == ("call", "event"):
        return MethodType(function, call)
    if names == ("event", "call"):
        return lambda event: function(event, call)
    if names == ("call",):
        return lambda event: function(call)
    if not names:
        return lambda event: function()
    return lambda event: call_impl(impl, {"call": call, "event": event})


def _frames(datas: list[bytes]) -> bytes:
    """The events of these data, one ``data:`` line each: the data copied twice (joined, then
    framed), not three times."""
    return b"".join((b"data: ", b"\n\ndata: ".join(datas), b"\n\n")) if datas else b""
