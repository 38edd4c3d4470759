"""What a completions stream reported, kept as its events pass, and how the stream ends.

``Bookkeeping``, a part of ``EventRelay`` (``plain_relay``): the finish reason of each choice
(``answered``: every choice asked for has had one), usage wherever the upstream puts it (vLLM's
``choices: []`` chunk, llama.cpp's last choice chunk, Ollama's zeros on every chunk, vLLM's running
totals), removed from the chunks as they pass and sent back as exactly one ``choices: []`` chunk,
priced, just before ``[DONE]`` when the client asked for it (``tail``). The last counts reported
win, except that zeros never replace counts, and that a stream with several choices (``n`` > 1)
may report each choice on its own: then the reports are combined (``Usage.combined``:
completions added, the prompt counted once). Also the error events that end a stream: the
upstream's (``_upstream_error``, put in OpenAI's form) and the gateway's own for an event it
cannot write back (``_unwritable``).
"""

from __future__ import annotations

from typing import Any

import orjson

from ...call import DROP
from ...sse import DONE_FRAME, data_frame
from ...usage import Usage
from .errors import StreamPluginError
from .event_json import write
from .usage_chunk import usage_chunk

UNWRITABLE = orjson.dumps({"error": {
    "message": "The upstream sent an event nested deeper than the gateway can write JSON back (254 levels).",
    "type": "upstream_error", "param": None, "code": "upstream_bad_response"}})


class Bookkeeping:
    """``EventRelay``'s record of what the stream reported (usage, finish reasons, its error) and
    its end (``answered``, ``tail``). Its state is ``EventRelay``'s (``__slots__`` there)."""

    __slots__ = ()

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
