"""The shape of a model server's answer, and what differs between two: ``kilnproxy replay --against``.

A shape says how an answer is built, never what it says: its status and
content type; for a stream, the framing (line endings, ``:`` comments, ``event:``
/ ``id:`` / ``retry:`` lines, whether ``[DONE]`` ends it, an error event and
where), where usage goes (a ``choices: []`` chunk, the last choice chunk, every
chunk, nowhere) and the fields the events carry, with their JSON types; for a
JSON answer, its fields; and the finish reasons. Two answers to one request
from two servers (or versions) differ in shape when a gateway or a plugin may
have to treat them differently.
"""

from __future__ import annotations

from typing import Any

import orjson

from .sse import COMMENT, DONE, SSEParser


def shape(status: int, content_type: str, chunks: list[bytes]) -> dict[str, Any]:
    body = b"".join(chunks)
    out: dict[str, Any] = {"status": status, "content type": content_type.split(";")[0].strip()}
    if not out["content type"] == "text/event-stream":
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError:
            return {**out, "body": "not JSON"}
        out["fields"] = _merged([_fields(doc)])
        out["finish reasons"] = _finish_reasons(doc)
        out["usage"] = "in the answer" if isinstance(doc, dict) and doc.get("usage") else "none"
        return out
    parser = SSEParser()
    items = [i for c in chunks for i in parser.feed(c)] + parser.close()
    data = [p for k, p in items if k != COMMENT]
    events = [_json(p) for p in data if p != DONE]
    lines = body.splitlines()
    out["framing"] = {
        "line ending": "CRLF" if b"\r\n" in body else "LF",
        "comments": sorted({p.decode("utf-8", "replace") for k, p in items if k == COMMENT}),
        "other fields": sorted({ln.split(b":")[0].decode() for ln in lines
                                if ln.split(b":")[0] in (b"event", b"id", b"retry")}),
        "ends with [DONE]": bool(data) and data[-1] == DONE,
        "error event": _error_at(events),
    }
    out["usage"] = _usage_placement(events)
    out["fields"] = _merged(_fields(e) for e in events if isinstance(e, dict))
    out["finish reasons"] = [r for e in events for r in _finish_reasons(e)]
    return out


def differences(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """One line per difference: ``what: old -> new`` (fields: what was added or removed)."""
    lines = []
    for key in dict.fromkeys([*old, *new]):
        a, b = old.get(key), new.get(key)
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            lines += differences(a, b, f"{prefix}{key}: ")
        elif key == "fields" and isinstance(a, list) and isinstance(b, list):
            lines += [f"{prefix}field only in the recording: {f}" for f in a if f not in b]
            lines += [f"{prefix}field only in the new answer: {f}" for f in b if f not in a]
        else:
            lines.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return lines


def _json(payload: bytes) -> Any:
    try:
        return orjson.loads(payload)
    except orjson.JSONDecodeError:
        return payload


def _fields(value: Any, path: str = "") -> set[str]:
    """``a.b[].c: type`` for every leaf; keys whose values vary by request (ids) keep their type only."""
    if isinstance(value, dict):
        if not value:
            return {f"{path}: object"}
        return set().union(*(_fields(v, f"{path}.{k}" if path else k) for k, v in value.items()))
    if isinstance(value, list):
        inner = set().union(*(_fields(v, f"{path}[]") for v in value)) if value else set()
        return inner or {f"{path}: array"}
    kind = {bool: "bool", int: "number", float: "number", str: "string", type(None): "null"}.get(type(value), "?")
    return {f"{path}: {kind}"}


def _merged(field_sets) -> list[str]:
    """The fields of all events; an empty array or object where other events have contents is not
    a field of its own (``choices: []`` beside ``choices[].text``)."""
    fields = set().union(set(), *field_sets)
    paths = {f.split(": ")[0] for f in fields}
    return sorted(f for f in fields if not (f.endswith((": array", ": object")) and any(
        p.startswith(f.split(": ")[0] + c) for p in paths for c in ("[]", "."))))


def _finish_reasons(doc: Any) -> list[str]:
    choices = doc.get("choices") if isinstance(doc, dict) else None
    return [c["finish_reason"] for c in choices or () if isinstance(c, dict) and c.get("finish_reason")]


def _usage_placement(events: list[Any]) -> str:
    with_usage = [i for i, e in enumerate(events) if isinstance(e, dict) and e.get("usage")]
    choice_events = [i for i, e in enumerate(events) if isinstance(e, dict) and e.get("choices")]
    if not with_usage:
        return "none"
    if len(with_usage) > 1 and len(with_usage) >= len(choice_events):
        return "every chunk"
    last = events[with_usage[-1]]
    if not last.get("choices"):
        return "a separate choices: [] chunk"
    return "in the last choice chunk"


def _error_at(events: list[Any]) -> str:
    for i, e in enumerate(events):
        if isinstance(e, dict) and ("error" in e or e.get("object") == "error"):
            return "last event" if i == len(events) - 1 else f"event {i + 1} of {len(events)}"
    return "none"
