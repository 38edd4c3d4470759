"""What keeps secrets out of fixtures: no credential header, no known secret in any usual encoding.

``Scrubber`` learns the secrets of one exchange (the request's
``Authorization`` (for ``Basic``, also the password alone), ``Proxy-Authorization``,
``Cookie`` and ``*-Key`` / ``*-Token`` header values, the values of secret-named fields of its JSON body, and any
``extra`` value such as an upstream key read from the environment), then:

* drops response headers whose name says credential (``Set-Cookie``,
  ``*Auth*``, ``*Key*``, ``*Token*``, ``*Secret*``...);
* replaces the value of every secret-named field of a JSON body with
  ``[REDACTED]``, at any depth;
* masks every occurrence of a secret, as is, base64 (standard and URL-safe,
  padded or not), hex, URL-encoded or JSON-escaped, and every ``Bearer <token>``
  (a token with a digit) and ``Basic <user:password in base64>``, with ``*`` of
  the same length, so that the response's chunk boundaries stay where they were.
"""

from __future__ import annotations

import base64
import re
from typing import Any, Iterable
from urllib.parse import quote, urlsplit, urlunsplit

import orjson

REDACTED = "[REDACTED]"
MIN_SECRET = 4  # shorter values would mask ordinary text
SECRET_NAME = re.compile(r"auth|cookie|key|token|secret|passw|credential|session", re.I)
# "Bearer <token>" / "Basic <base64 of user:password>" in a body: a token has a digit, which keeps
# ordinary prose ("the bearer of good news") out.
CREDENTIAL = re.compile(rb"\b([Bb]earer|[Bb]asic|BEARER|BASIC)\s+([A-Za-z0-9._~+/=-]{8,})")


class Scrubber:
    def __init__(self, extra: Iterable[str] = ()):
        self.secrets: set[str] = {s for s in extra if s and len(s) >= MIN_SECRET}
        self._pattern: re.Pattern | None = None

    def learn_headers(self, headers: Any) -> None:
        for name, value in headers.items():
            if SECRET_NAME.search(name):
                self._learn_credential(value)

    def _learn_credential(self, value: str) -> None:
        self._add(value)
        scheme, _, token = value.partition(" ")
        if token:
            self._add(token.strip())
            if scheme.lower() == "basic":
                try:
                    plain = base64.b64decode(token.strip(), validate=True).decode("utf-8")
                except ValueError:
                    return
                self._add(plain)
                self._add(plain.partition(":")[2])  # the password; a user name is no secret
        for part in re.split(r"[;,]\s*", value):  # Cookie: a=1; b=2
            self._add(part.partition("=")[2])

    def _add(self, value: str) -> None:
        if value and len(value) >= MIN_SECRET:
            self.secrets.add(value)
            self._pattern = None

    def learn_body(self, body: Any) -> None:
        for value in _secret_values(body):
            self._add(value)

    # -- applying ---------------------------------------------------------------

    def headers(self, headers: dict[str, str]) -> dict[str, str]:
        return {k: self.text(v) for k, v in headers.items() if not SECRET_NAME.search(k)}

    def body(self, body: Any) -> Any:
        if isinstance(body, dict):
            return {k: REDACTED if isinstance(v, str) and v and _secret_name(k) else self.body(v)
                    for k, v in body.items()}
        if isinstance(body, list):
            return [self.body(v) for v in body]
        if isinstance(body, str):
            return self.text(body)
        return body

    def text(self, value: str) -> str:
        return self.data(value.encode("utf-8")).decode("utf-8")

    def data(self, data: bytes) -> bytes:
        """``data`` with every secret masked; the same length as ``data``."""
        data = CREDENTIAL.sub(_mask_credential, data)
        pattern = self.pattern()
        return data if pattern is None else pattern.sub(lambda m: b"*" * len(m.group(0)), data)

    def chunks(self, chunks: list[bytes]) -> list[bytes]:
        """Mask across chunk boundaries too (a secret cut in two), keeping every chunk's length."""
        whole = self.data(b"".join(chunks))
        out, at = [], 0
        for chunk in chunks:
            out.append(whole[at:at + len(chunk)])
            at += len(chunk)
        return out

    def pattern(self) -> re.Pattern | None:
        if self._pattern is None and self.secrets:
            forms = set()
            for secret in self.secrets:
                forms.update(_encodings(secret.encode("utf-8")))
            forms = sorted((f for f in forms if len(f) >= MIN_SECRET), key=len, reverse=True)
            self._pattern = re.compile(b"|".join(re.escape(f) for f in forms))
        return self._pattern


# Field names that match SECRET_NAME but hold no secret in an OpenAI-style body.
HARMLESS = {"prompt_cache_key"}


def _secret_name(name: str) -> bool:
    return bool(SECRET_NAME.search(name)) and name not in HARMLESS and not name.endswith("tokens")


def _mask_credential(match: re.Match) -> bytes:
    scheme, token = match.group(1), match.group(2)
    if scheme.lower() == b"basic":
        try:
            credential = b":" in base64.b64decode(token, validate=True)
        except ValueError:
            credential = False
    else:
        credential = any(c in b"0123456789" for c in token)
    if not credential:
        return match.group(0)
    return match.group(0)[:-len(token)] + b"*" * len(token)


def _secret_values(body: Any) -> Iterable[str]:
    if isinstance(body, dict):
        for k, v in body.items():
            if isinstance(v, str) and _secret_name(k):
                yield v
            else:
                yield from _secret_values(v)
    elif isinstance(body, list):
        for v in body:
            yield from _secret_values(v)


def _encodings(raw: bytes) -> Iterable[bytes]:
    yield raw
    for enc in (base64.b64encode(raw), base64.urlsafe_b64encode(raw)):
        yield enc
        yield enc.rstrip(b"=")
    yield raw.hex().encode()
    yield raw.hex().upper().encode()
    yield quote(raw, safe="").encode()
    yield orjson.dumps(raw.decode("utf-8", "replace"))[1:-1]


def safe_url(url: str) -> str:
    """``url`` without its user info, query and fragment (where credentials hide)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))
