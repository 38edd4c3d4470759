"""The access log: one JSON line per request on stdout (``[log] access``).

A line is built where the request's usage row is built (``Gateway.row_observers``),
from that row: generation id, org, key id (never the key), model, endpoint,
status, error code, tokens, cost, duration, time to first token, upstream and
whether the client left early. The request body (prompt or messages, as sent
upstream) is added only with ``[log] bodies = true``; completions are never logged.

Lines finished in the same turn of the event loop go out in one write.
Diagnostics (start-up, reloads, errors) go to stderr through ``logging``, so
stdout carries nothing but these lines after the start-up banner.
"""

from __future__ import annotations

import asyncio
import logging
import sys

import orjson

from .record import RequestRecord

log = logging.getLogger("kilnproxy")


class AccessLog:
    def __init__(self, bodies: bool = False, stream=None):
        self.bodies = bodies
        self.stream = stream  # None: sys.stdout as it is at write time
        self._lines: list[bytes] = []
        self._broken = False

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
            "upstream": record.call.upstream,
            "disconnected": bool(row["disconnected"]),
        }
        if self.bodies:
            line["body"] = record.body
        if not self._lines:
            asyncio.get_running_loop().call_soon(self.flush)
        self._lines.append(orjson.dumps(line, option=orjson.OPT_APPEND_NEWLINE))

    def flush(self) -> None:
        lines, self._lines = self._lines, []
        if not lines or self._broken:
            return
        stream = self.stream or sys.stdout
        data = b"".join(lines)
        try:
            buffer = getattr(stream, "buffer", None)
            if buffer is not None:
                buffer.write(data)
            else:
                stream.write(data.decode())
            stream.flush()
        except (OSError, ValueError) as exc:  # stdout closed or a broken pipe
            self._broken = True
            log.error("access log disabled: cannot write to stdout: %s", exc)
