"""``BatchCredential``: how the Batch API's runner sends a batch's lines through the whole request path.

The runner sends each line to this process's own listener as a request of the key that created the
batch. It cannot hold that key's secret (the store keeps only its SHA-256), so it authenticates with a
credential of this process: ``Bearer kiln-batch.<secret>.<batch id>.<generation id>``, where the
secret is random, made when the process starts, never written to a log, a row or the store, and
compared in constant time. It is looked at only after the token matched no key (a client's request
never pays for it), and it names only batches the runner registered (``running``). Authentication
then resolves it to the batch's key as it is now (a key revoked or disabled since refuses the line,
as it would refuse the client) at batch priority, the line's generation id, and its batch. The token
goes no further: the gateway sends upstream a request of its own, not the client's headers.
"""

from __future__ import annotations

import hmac
import secrets
from dataclasses import dataclass, replace

from ...access import bearer_token
from ...config import KeyConfig

PREFIX = b"kiln-batch."


@dataclass(frozen=True)
class BatchLine:
    """What a request of the runner carries beside its key: its batch and its generation id."""

    batch_id: str
    generation_id: str


class BatchCredential:
    def __init__(self) -> None:
        self._secret = secrets.token_hex(32).encode()
        self.running: dict[str, str] = {}  # batch id -> the id of the key that created it, while it runs here

    def header(self, batch_id: str, generation_id: str) -> str:
        """The ``Authorization`` header of the line sent under ``generation_id``."""
        return f"Bearer {PREFIX.decode()}{self._secret.decode()}.{batch_id}.{generation_id}"

    def resolve(self, header: str | None, key_of) -> tuple[KeyConfig, BatchLine] | None:
        """The batch's key (``key_of(key_id)``: the key as it is now, or None) at batch priority and the
        line, when ``header`` is this process's credential for a batch it runs; else None."""
        token = bearer_token(header)
        if token is None or not token.startswith(PREFIX):
            return None
        secret, _, rest = token[len(PREFIX):].partition(b".")
        if not hmac.compare_digest(secret, self._secret):
            return None
        batch_id, _, generation_id = rest.decode("ascii", "replace").partition(".")
        key_id = self.running.get(batch_id)
        if key_id is None or not generation_id.startswith("gen-"):
            return None
        key = key_of(key_id)
        if key is None:
            return None
        return replace(key, priority="batch"), BatchLine(batch_id, generation_id)
