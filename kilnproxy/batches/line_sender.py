"""``LineSender``: a batch's line sent as a request to this gateway's own listener.

So each line takes the whole request path a client's request takes (authentication, the request
rules, holds, plugins, the upstream, one usage row), as the batch's key at batch priority, through
the runner's credential (``kilnproxy.proxy.tenancy.batch_credential``). ``stream`` is forced off
(``stream_options`` dropped with it): a line's answer is one JSON body.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson

from ..proxy.tenancy.batch_credential import BatchCredential


class LineNotSent(Exception):
    """The line's request failed before an answer came (the gateway stopping): its outcome is unknown."""


def line_body(body_json: str) -> bytes:
    body = orjson.loads(body_json)
    if "stream" in body:
        body["stream"] = False
    body.pop("stream_options", None)
    return orjson.dumps(body)


class LineSender:
    def __init__(self, credential: BatchCredential, base_url: str, connections: int):
        self.credential = credential
        self.base_url = base_url
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=connections, force_close=False),
            timeout=aiohttp.ClientTimeout(total=None), auto_decompress=False)

    async def send(self, batch_id: str, endpoint: str, line: dict[str, Any]) -> tuple[int, Any, dict[str, str]]:
        """The line's answer: its status, its body (JSON, or the text of a body that is not), its headers."""
        headers = {"Authorization": self.credential.header(batch_id, line["generation_id"]),
                   "Content-Type": "application/json"}
        try:
            async with self.session.post(self.base_url + endpoint, data=line_body(line["body"]),
                                         headers=headers) as resp:
                raw = await resp.read()
                status, answer_headers = resp.status, dict(resp.headers)
        except (aiohttp.ClientError, OSError) as exc:
            raise LineNotSent(f"{type(exc).__name__}: {exc}") from None
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = raw.decode("utf-8", "replace")
        return status, body, answer_headers

    async def close(self) -> None:
        await self.session.close()
