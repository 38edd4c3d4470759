"""webhook: POST every usage event as JSON to a URL (billing, alerting, a data pipeline).

One POST per request (errors, refusals and disconnects included), body: the
usage row as a JSON object with the columns of the ``usage_events`` table,
sent once the row is committed to the gateway's own database. Install::

    [plugins]
    modules = ["plugins/webhook.py"]

    [plugins.settings.webhook]
    url = "https://billing.internal/kiln-usage"   # required
    timeout = 5                                   # seconds per POST
    headers = { Authorization = "Bearer ..." }    # optional extra headers

A POST that fails (no answer within ``timeout``, a refused connection, a
status >= 300) is logged on ``kilnproxy.plugins.webhook`` and not retried:
the row stays in the gateway's database (``python -m kilnproxy usage``, or
``GET /v1/generations/{id}``) for a later reconciliation. POSTs go out one at
a time, off the requests' path: a slow receiver delays the next POST, never
a response.
"""

from __future__ import annotations

import logging

import aiohttp
import orjson

from kilnproxy import hookimpl

NAME = "webhook"
log = logging.getLogger("kilnproxy.plugins.webhook")
_clients: dict = {}  # gateway -> Client


class Client:
    def __init__(self, url: str, timeout: float, headers: dict):
        self.url = url
        self.headers = {"Content-Type": "application/json", **headers}
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout))

    async def post(self, usage) -> None:
        try:
            async with self.session.post(self.url, data=orjson.dumps(dict(usage)), headers=self.headers) as resp:
                if resp.status >= 300:
                    log.warning("webhook %s answered HTTP %d for usage event %s", self.url, resp.status, usage["id"])
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("webhook %s failed for usage event %s: %s", self.url, usage["id"],
                        f"{type(exc).__name__}: {exc}".rstrip(": "))


@hookimpl
async def startup(gateway):
    settings = gateway.plugin_settings(NAME)
    url = settings.get("url")
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ValueError('[plugins.settings.webhook] url is required: url = "https://host/path"')
    timeout = settings.get("timeout", 5)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError("[plugins.settings.webhook] timeout must be a number of seconds > 0")
    headers = settings.get("headers", {})
    if not isinstance(headers, dict) or not all(isinstance(v, str) for v in headers.values()):
        raise ValueError("[plugins.settings.webhook] headers must be a table of strings")
    _clients[gateway] = Client(url, float(timeout), headers)


@hookimpl
async def record_usage(call, usage):
    await _clients[call.gateway].post(usage)


@hookimpl
async def shutdown(gateway):
    client = _clients.pop(gateway, None)
    if client is not None:
        await client.session.close()
