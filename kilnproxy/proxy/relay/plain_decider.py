"""Which events of a completions stream go out as they came: the per-event decision (no plugin loaded).

``PlainDecider``, a part of ``EventRelay`` (``plain_relay``): ``feed`` and ``feed_data`` take
whole events one by one; ``_event`` decides each with substring tests on its payload
(``find``: a bytes ``in`` tries its operand as an int first, a raised error's cost) whether it
goes out as the upstream's own bytes, the model's name replaced, or is parsed
(``_parsed_event``): when it carries usage, an error or a finish reason, or when its bytes do not
show which ``"model":`` is the event's own (``plain_scanner``: ``TOP``). With ``transform_event``
plugins every event takes ``plain_transforms``' path instead. What is read from a parsed event
(usage, finish reasons, errors) is kept by ``plain_bookkeeping``.
"""

from __future__ import annotations

import orjson

from ...sse import COMMENT, data_frame, is_done, lines_frame
from .errors import StreamPluginError
from .event_json import read_stdlib, write
from .plain_scanner import (ERROR, FINISH, FINISH_NULL, LF, MODEL_KEY, ROLE, USAGE, USAGE_NULL, closes_top,
                            opens_top, role_only)

FINISH_LEN = len(FINISH)


class PlainDecider:
    """``EventRelay``'s per-event part: what to send for each whole event, decided from its bytes,
    parsed only where they do not tell. Its state is ``EventRelay``'s (``__slots__`` there)."""

    __slots__ = ()

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
            self.record.streamed_chunks += not self.chat or find(ROLE) < 0 or not role_only(payload)
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
            self.record.streamed_chunks += not self.chat or ROLE not in payload or not role_only(payload)
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
