"""Who may call the operator's surfaces (``/metrics``, ``/admin/*``, the inspector): one rule, here.

Two ways in:

* a bearer token, compared by its sha256 (``token_matches``) so that a token
  whose bytes are not ASCII or UTF-8 is simply a wrong token, never an error;
* a *local* request (``local_request``): the peer address is loopback, the
  ``Host`` header names a loopback host (``localhost``, ``*.localhost``,
  ``127.x.x.x``, ``[::1]``), and an ``Origin`` header, when a browser sends
  one, names that same host. A web page on another site that a browser on
  the gateway's machine has loaded cannot pass: through DNS rebinding its
  requests carry that site's name as ``Host``; a cross-site ``fetch`` or form
  (a POST to ``/admin/reload``) carries its own ``Origin``.

The peer address is what counts; ``X-Forwarded-For`` is ignored.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from typing import Iterable
from urllib.parse import urlsplit

from aiohttp import web


def bearer_token(header: str | None) -> bytes | None:
    """The token of ``Authorization: Bearer <token>`` as the bytes the client sent, else None.

    aiohttp decodes header bytes that are not UTF-8 as surrogates; ``surrogateescape``
    gives those bytes back, so such a token hashes like any other (and matches nothing).
    """
    if not header or header[:7].lower() != "bearer ":
        return None
    token = header[7:].strip()
    return token.encode("utf-8", "surrogateescape") if token else None


def token_digest(token: bytes) -> str:
    return hashlib.sha256(token).hexdigest()


def token_matches(token: bytes | None, digests: Iterable[str | None]) -> bool:
    """Whether ``token`` is one of the configured tokens, given as sha256 hex digests (None: not set)."""
    if token is None:
        return False
    digest = token_digest(token)
    return any(d is not None and hmac.compare_digest(digest, d) for d in digests)


def local_request(request: web.Request) -> bool:
    """From a loopback peer, under a loopback ``Host``, and not sent by a page of another origin."""
    if not (loopback_peer(request.remote) and loopback_host(request.host)):
        return False
    origin = request.headers.get("Origin")
    return origin is None or _same_host(origin, request.host)


def loopback_peer(remote: str | None) -> bool:
    try:
        return remote is not None and ipaddress.ip_address(remote.split("%")[0]).is_loopback
    except ValueError:
        return False


def loopback_host(host: str) -> bool:
    """``host`` (a ``Host`` header, port included or not) names this machine's loopback interface."""
    name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
    name = name.strip("[]").lower()
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _same_host(origin: str, host: str) -> bool:
    try:
        netloc = urlsplit(origin).netloc
    except ValueError:
        return False
    return bool(netloc) and netloc.lower() == host.lower()
