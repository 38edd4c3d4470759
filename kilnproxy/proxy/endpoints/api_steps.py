"""The steps the embeddings, Responses and Messages APIs take alike (their modules: ``embeddings``,
``responses``, ``messages``).

Their streams keep their ``event:`` framing and go through ``framed_writer`` (``relay``), and
their answers' usage is read from each format's own usage object (``read_usage``:
``Usage.of_endpoint``), its counts capped as the row's are.
"""

from __future__ import annotations

import aiohttp
from aiohttp import web

from ...call import Call
from ...usage import Usage, cap_counts
from ..framed_writer import relay_framed
from ..gateway import Gateway
from ..request_record import RequestRecord
from ..upstream.routes import Route


async def relay(request: web.BaseRequest, gw: Gateway, call: Call, route: Route, record: RequestRecord,
                resp: aiohttp.ClientResponse, headers: dict, first: bytes | None) -> web.StreamResponse:
    """``request_path.Api.relay`` for a framed stream (the route is not needed)."""
    return await relay_framed(request, gw, call, record, resp, headers, first)


def read_usage(call: Call, record: RequestRecord, answer: dict) -> None:
    """The answer's usage object, in its endpoint's form, as the record's usage (its counts capped)."""
    usage = answer.get("usage")
    if isinstance(usage, dict):
        cap_counts(usage)
        record.usage = Usage.of_endpoint(call.endpoint, usage)
