"""API keys: ``Authorization: Bearer <key>`` -> the key's config entry."""

from __future__ import annotations

from ..access import bearer_token, token_digest
from ..config import KeyConfig
from ..errors import GatewayError, forbidden, invalid_api_key


class KeyRing:
    """Keys are held by their sha256 only, so a config may list just the digests."""

    def __init__(self, keys: tuple[KeyConfig, ...]):
        self._by_digest = {k.key_sha256: k for k in keys}
        self._by_token: dict[bytes, KeyConfig] = {}  # tokens already matched: one per key at most

    def authenticate(self, header: str | None) -> KeyConfig:
        """The key of a request, or 401 ``invalid_api_key`` (whatever bytes the header holds).
        A disabled key is returned: the caller answers 403 after it knows whom to record
        the request against."""
        token = bearer_token(header)
        if token is None:
            raise invalid_api_key()
        key = self._by_token.get(token)
        if key is not None:
            return key
        key = self._by_digest.get(token_digest(token))
        if key is None:
            raise invalid_api_key()
        self._by_token[token] = key
        return key


def key_disabled() -> GatewayError:
    return forbidden("This API key is disabled.")
