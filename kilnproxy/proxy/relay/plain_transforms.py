"""A completions stream with ``transform_event`` plugins: each event parsed once, shown to the plugins, written once.

``PluggedEvents``, a part of ``EventRelay`` (``plain_relay``). With plugins loaded every event is
parsed (``_plugged``), checked by the same rules as ``plain_decider``'s parsed events, handed to
each plugin (``event_plugins.event_only``: its ``call`` bound once per stream) and serialised
once. ``_plugged_data`` takes a stream's usual event in line with one plugin: its loop is the
cost of every event of every stream that has a plugin. A plugin that raises, or leaves the event
no longer JSON, ends the stream with a ``StreamPluginError`` (naming every ``transform_event``
plugin when several saw the event); an event the gateway cannot write back is the upstream's
fault (``plain_bookkeeping``: ``_unwritable``).
"""

from __future__ import annotations

import logging
from typing import Any

import orjson

from ...call import DROP, STOP
from ...plugins.manager import Impl
from ...sse import is_done
from .errors import StreamPluginError
from .event_json import read_stdlib, writable, write
from .plain_scanner import ROLE, role_only

log = logging.getLogger("kilnproxy.plugins")


class PluggedEvents:
    """``EventRelay``'s path with ``transform_event`` plugins. Its state is ``EventRelay``'s
    (``__slots__`` there)."""

    __slots__ = ()

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
                if event.get("choices") and (not chat or ROLE not in payload or not role_only(payload)):
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
            exc.before = frames(out) + exc.before
            raise
        finally:
            record.streamed_chunks += counted
        return frames(out)

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
            exc.before = frames(out) + exc.before
            raise
        return frames(out)

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
        line for a stream's usual event: a rule changed here changes there (tests/proxy/relay/test_relay_chunks.py
        compares the two on every odd stream)."""
        if not isinstance(event, dict):
            return payload
        if event.get("error") is not None or event.get("object") == "error":
            return self._upstream_error(event)
        choices = event.get("choices")
        if event.get("usage") is not None and self._usage_taken(event, choices):
            return None
        if choices:
            self.record.streamed_chunks += not self.chat or ROLE not in payload or not role_only(payload)
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


def frames(datas: list[bytes]) -> bytes:
    """The events of these data, one ``data:`` line each: the data copied twice (joined, then
    framed), not three times."""
    return b"".join((b"data: ", b"\n\ndata: ".join(datas), b"\n\n")) if datas else b""
