"""The access log: one JSON line per request on stdout (``[log] access``).

A line is built where the request's usage row is built (``Gateway.row_observers``),
from that row: generation id, org, key id (never the key), model, endpoint,
status, error code, tokens, cost, duration, time to first token, upstream and
whether the client left early. The request body (prompt or messages, as sent
upstream) is added only with ``[log] bodies = true``; completions are never logged.

Lines are written in batches, at most ``FLUSH_SECONDS`` after the request
ended (one write for many requests under load; usage rows are in SQLite
already, so a crash can only cost that moment's log lines). When
stdout is a pipe or a socket, writes never block the event loop: what the
reader has not taken yet waits in memory, up to ``MAX_PENDING`` bytes; lines
beyond that are dropped and counted (``dropped``), with one line on stderr, so
a stalled log reader can cost log lines but never stall requests.
Diagnostics (start-up, reloads, errors) go to stderr through ``logging``, so
stdout carries nothing but these lines after the start-up banner.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import sys

import orjson

from ..proxy.relay.event_json import write
from ..proxy.request_record import RequestRecord

log = logging.getLogger("kilnproxy")

FLUSH_SECONDS = 0.05


class AccessLog:
    def __init__(self, bodies: bool = False, stream=None):
        self.bodies = bodies
        self.stream = stream  # None: sys.stdout as it is at write time
        self._lines: list[bytes] = []
        self._broken = False
        self._pipe: _NonBlockingPipe | bool | None = None  # decided at the first write

    def __call__(self, row: dict, record: RequestRecord) -> None:
        line = {
            "time": row["created_at"],
            "generation_id": row["id"],
            "org": row["org"],
            "key_id": row["key_id"],
            "model": row["model"],
            "endpoint": row["endpoint"],
            "stream": bool(row["stream"]),
            "status": row["status"],
            "error_code": row["error_code"],
            "prompt_tokens": row["prompt_tokens"],
            "completion_tokens": row["completion_tokens"],
            "cached_tokens": row["cached_tokens"],
            "cost": row["cost"],
            "duration_ms": row["duration_ms"],
            "ttft_ms": row["ttft_ms"],
            "finish_reason": row["finish_reason"],
            "upstream": row["upstream"],  # userinfo removed
            "disconnected": bool(row["disconnected"]),
        }
        if self.bodies:
            line["body"] = record.body
        if not self._lines:
            asyncio.get_running_loop().call_later(FLUSH_SECONDS, self.flush)
        try:
            self._lines.append(orjson.dumps(line, option=orjson.OPT_APPEND_NEWLINE))
        except TypeError:  # the body escapes a lone surrogate, which only the json module writes
            self._lines.append(write(line) + b"\n")

    def flush(self) -> None:
        lines, self._lines = self._lines, []
        if not lines or self._broken:
            return
        data = b"".join(lines)
        try:
            if self.stream is None and self._pipe is None:
                self._pipe = _NonBlockingPipe.for_stdout()
            if self._pipe:
                self._pipe.write(data, len(lines))
                return
            stream = self.stream or sys.stdout
            buffer = getattr(stream, "buffer", None)
            if buffer is not None:
                buffer.write(data)
            else:
                stream.write(data.decode())
            stream.flush()
        except (OSError, ValueError) as exc:  # stdout closed or a broken pipe
            self._broken = True
            log.error("access log disabled: cannot write to stdout: %s", exc)

    @property
    def dropped(self) -> int:
        return self._pipe.dropped if self._pipe else 0


class _NonBlockingPipe:
    """Writes to a pipe or socket fd without ever blocking the event loop."""

    MAX_PENDING = 8 * 1024 * 1024

    def __init__(self, fd: int):
        self.fd = fd
        self.pending = bytearray()
        self.dropped = 0
        os.set_blocking(fd, False)

    @classmethod
    def for_stdout(cls) -> "_NonBlockingPipe | bool":
        """A writer for stdout when it is a pipe or socket; ``False`` otherwise
        (files and terminals take plain writes)."""
        try:
            sys.stdout.flush()
            fd = sys.stdout.fileno()
            mode = os.fstat(fd).st_mode
        except (OSError, ValueError, AttributeError):
            return False
        return cls(fd) if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) else False

    def write(self, data: bytes, lines: int) -> None:
        if self.pending:
            if len(self.pending) + len(data) > self.MAX_PENDING:
                self._drop(lines)
            else:
                self.pending += data
            return
        try:
            sent = os.write(self.fd, data)
        except BlockingIOError:
            sent = 0
        if sent < len(data):
            self.pending += data[sent:]
            asyncio.get_running_loop().add_writer(self.fd, self._drain)

    def _drain(self) -> None:
        try:
            sent = os.write(self.fd, self.pending)
        except BlockingIOError:
            return
        except OSError:
            self.pending.clear()
            sent = 0
        del self.pending[:sent]
        if not self.pending:
            asyncio.get_running_loop().remove_writer(self.fd)

    def _drop(self, lines: int) -> None:
        if not self.dropped:
            log.error("access log: stdout is not being read; dropping lines until it is")
        self.dropped += lines
