"""API keys: ``Authorization: Bearer <key>`` (or ``x-api-key: <key>``, as Anthropic's clients send it, where
``either_header`` reads it) -> the key's config entry."""

from __future__ import annotations

import time
from typing import Mapping

from ...access import bearer_token, token_digest
from ...config import KeyConfig
from ...errors import GatewayError, forbidden, invalid_api_key


class KeyRing:
    """Keys are held by their sha256 only, so a config may list just the digests. A revoked key is
    not in the ring; an expired one is refused as unknown."""

    def __init__(self, keys: tuple[KeyConfig, ...]):
        self._by_digest = {k.key_sha256: k for k in keys}
        self._by_id = {k.id: k for k in keys}
        self._by_token: dict[bytes, KeyConfig] = {}  # tokens already matched: one per key at most

    def authenticate(self, header: str | None) -> KeyConfig:
        """The key of a request, or 401 ``invalid_api_key`` (whatever bytes the header holds).
        A disabled key is returned: the caller answers 403 after it knows whom to record
        the request against."""
        token = bearer_token(header)
        if token is None:
            raise invalid_api_key()
        key = self._by_token.get(token)
        if key is None:
            key = self._by_digest.get(token_digest(token))
            if key is None:
                raise invalid_api_key()
            self._by_token[token] = key
        if key.expires_at is not None and key.expires_at <= time.time():
            raise invalid_api_key()  # like an unknown key: no org charged, no row
        return key

    def by_id(self, key_id: str) -> KeyConfig | None:
        """The key of id ``key_id`` (None: revoked, expired, or never known), for the Batch API's runner."""
        key = self._by_id.get(key_id)
        if key is None or (key.expires_at is not None and key.expires_at <= time.time()):
            return None
        return key


def either_header(headers: Mapping[str, str]) -> str | None:
    """The ``Authorization`` header to check: the client's, or without one its ``x-api-key`` as a bearer. Read
    by Anthropic's endpoints and the read endpoints (``/v1/models`` ...), which Anthropic's clients call with
    ``x-api-key`` and ``anthropic-version``; a bearer, when sent, is the key whatever ``x-api-key`` says."""
    header = headers.get("Authorization")
    if header is None:
        api_key = headers.get("x-api-key")
        return None if api_key is None else f"Bearer {api_key}"
    return header


def key_disabled() -> GatewayError:
    return forbidden("This API key is disabled.")


def org_disabled(org: str) -> GatewayError:
    return forbidden(f"Organization `{org}` is disabled.")


def check_enabled(key: KeyConfig, disabled_orgs: frozenset[str]) -> None:
    """403 for a disabled key, or a key of a disabled org (request rule 1)."""
    if key.disabled:
        raise key_disabled()
    if key.org in disabled_orgs:
        raise org_disabled(key.org)
