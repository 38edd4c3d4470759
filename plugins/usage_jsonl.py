"""usage_jsonl: append every usage event to a JSON-lines file, for log shippers and ad-hoc analysis.

One line per request (errors, refusals and disconnects included), with the
columns of the ``usage_events`` table, written once the row is committed to
the gateway's own database. Install::

    [plugins]
    modules = ["plugins/usage_jsonl.py"]

    [plugins.settings.usage_jsonl]
    path = "usage.jsonl"   # relative to the config file; required
    fsync = false          # true: fsync after each line (slower; survives a power cut)

The file is opened once, in append mode, at start-up and closed at shutdown.
Each line goes out in one unbuffered ``write``, so ``tail -f usage.jsonl``
follows the traffic and several gateways may append to one file. Rotate it
with ``logrotate``'s ``copytruncate``.
"""

from __future__ import annotations

import os

import orjson

from kilnproxy import hookimpl

NAME = "usage_jsonl"
_sinks: dict = {}  # gateway -> its open file (one per running gateway)


@hookimpl
def startup(gateway):
    settings = gateway.plugin_settings(NAME)
    path = settings.get("path")
    if not isinstance(path, str) or not path:
        raise ValueError('[plugins.settings.usage_jsonl] path is required, e.g. path = "usage.jsonl"')
    full = gateway.config.resolve(path)
    full.parent.mkdir(parents=True, exist_ok=True)
    _sinks[gateway] = Sink(open(full, "ab", buffering=0), bool(settings.get("fsync", False)))


@hookimpl
def record_usage(call, usage):
    _sinks[call.gateway].write(usage)


@hookimpl
def shutdown(gateway):
    sink = _sinks.pop(gateway, None)
    if sink is not None:
        sink.close()


class Sink:
    __slots__ = ("file", "fsync")

    def __init__(self, file, fsync: bool):
        self.file = file
        self.fsync = fsync

    def write(self, usage) -> None:
        self.file.write(orjson.dumps(dict(usage)) + b"\n")
        if self.fsync:
            os.fsync(self.file.fileno())

    def close(self) -> None:
        self.file.close()
