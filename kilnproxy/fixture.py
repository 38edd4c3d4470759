"""The fixture format: one recorded exchange with a model server, as one JSON file (docs/fixtures.md).

A fixture holds the request (method, path, body as sent upstream) and the
response: status, headers, the delay before the headers, and the body as the
byte chunks in the order and with the delays they arrived in, then how the body
ended (``eof``; ``client_gone`` when the recording client left first;
``reset`` when the server broke the connection). Each chunk is
``{"ms": delay since the previous one, "text": ...}``, or ``"base64"`` instead of
``text`` when the chunk is not valid UTF-8 on its own (a character cut in two).

``FORMAT`` is the version written in ``kilnproxy_fixture``; ``load`` refuses
any other with a ``FixtureError`` that names the file.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from .errors import KilnError

FORMAT = 1
ENDS = ("eof", "client_gone", "reset")


class FixtureError(KilnError):
    """A file that is not a fixture this version can read."""


@dataclass
class Chunk:
    ms: float
    data: bytes

    def to_json(self) -> dict[str, Any]:
        try:
            return {"ms": self.ms, "text": self.data.decode("utf-8")}
        except UnicodeDecodeError:
            return {"ms": self.ms, "base64": base64.b64encode(self.data).decode("ascii")}

    @classmethod
    def from_json(cls, item: dict) -> "Chunk":
        data = item["text"].encode("utf-8") if "text" in item else base64.b64decode(item["base64"])
        return cls(float(item["ms"]), data)


@dataclass
class Fixture:
    path: str  # of the request, e.g. /v1/completions
    body: Any  # the request body: parsed JSON, or a str when it was not JSON
    status: int
    headers: dict[str, str]
    chunks: list[Chunk] = field(default_factory=list)
    headers_ms: float = 0.0  # from the request sent to the response's headers
    end: str = "eof"
    method: str = "POST"
    recorded_at: str | None = None
    source: str | None = None  # where it was recorded (the upstream's base URL, or a description)
    file: Path | None = None  # where it was loaded from

    @property
    def content(self) -> bytes:
        """The whole response body."""
        return b"".join(c.data for c in self.chunks)

    @property
    def model(self) -> Any:
        return self.body.get("model") if isinstance(self.body, dict) else None

    @property
    def stream(self) -> bool:
        return isinstance(self.body, dict) and truthy(self.body.get("stream"))

    def to_json(self) -> dict[str, Any]:
        return {
            "kilnproxy_fixture": FORMAT,
            "recorded_at": self.recorded_at,
            "source": self.source,
            "request": {"method": self.method, "path": self.path, "body": self.body},
            "response": {"status": self.status, "headers": self.headers, "headers_ms": self.headers_ms,
                         "chunks": [c.to_json() for c in self.chunks], "end": self.end},
        }

    def dumps(self) -> bytes:
        return orjson.dumps(self.to_json(), option=orjson.OPT_INDENT_2) + b"\n"

    def save(self, path: Path) -> Path:
        """Write atomically (a reader never sees half a file)."""
        path = Path(path)
        partial = path.with_name(path.name + ".partial")
        partial.write_bytes(self.dumps())
        partial.replace(path)
        return path


def truthy(value: Any) -> bool:
    """``stream``'s truth value as SPEC section 4 step 6 reads it."""
    return value is True or value == "true" or (type(value) is int and value == 1)


def load(path: Path | str) -> Fixture:
    path = Path(path)
    try:
        doc = orjson.loads(path.read_bytes())
    except (OSError, orjson.JSONDecodeError) as exc:
        raise FixtureError(f"{path}: cannot read it as a fixture: {exc}") from None
    if not isinstance(doc, dict) or doc.get("kilnproxy_fixture") != FORMAT:
        version = doc.get("kilnproxy_fixture") if isinstance(doc, dict) else None
        raise FixtureError(f"{path}: not a kilnproxy fixture of format {FORMAT} (kilnproxy_fixture = {version!r})")
    try:
        req, resp = doc["request"], doc["response"]
        end = resp.get("end", "eof")
        if end not in ENDS:
            raise ValueError(f"end must be one of {', '.join(ENDS)}")
        return Fixture(path=req["path"], body=req.get("body"), status=int(resp["status"]),
                       headers=dict(resp.get("headers") or {}), headers_ms=float(resp.get("headers_ms", 0)),
                       chunks=[Chunk.from_json(c) for c in resp.get("chunks", [])], end=end,
                       method=req.get("method", "POST"), recorded_at=doc.get("recorded_at"),
                       source=doc.get("source"), file=path)
    except (KeyError, TypeError, ValueError) as exc:
        raise FixtureError(f"{path}: a malformed fixture: {exc!r}") from None


def load_all(*sources: Path | str) -> list[Fixture]:
    """The fixtures of files and folders (a folder's ``*.json``, sorted by name)."""
    out = []
    for source in sources:
        source = Path(source)
        if source.is_dir():
            out.extend(load(p) for p in sorted(source.glob("*.json")))
        elif source.exists():
            out.append(load(source))
        else:
            raise FixtureError(f"{source}: no such fixture file or folder")
    return out
