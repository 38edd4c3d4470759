"""POST /v1/completions and /v1/chat/completions: their part of the request's path (``request_path``).

After admission: ``stream`` and the chat parameters checked (steps 6-7); the
upstream's answer (``forward``) read for its usage here, or its stream relayed
line by line (``stream``).
"""

from __future__ import annotations

from functools import partial
from typing import Callable

from aiohttp import web

from ...call import Call
from ...usage import Usage, cap_counts
from .. import rules
from ..gateway import GATEWAY, Gateway
from ..request_path import Api, handle
from ..request_record import RequestRecord
from ..stream_writer import relay_stream
from ..upstream.routes import Route


def _checks(body: dict, call: Call, route: Route) -> None:
    rules.check_stream(body, call)  # step 6
    rules.check_choices(body)
    rules.check_chat_params(body, call, route)  # step 7


async def completions(request: web.Request) -> web.StreamResponse:
    return await handle(request, request.app[GATEWAY], "completions", COMPLETIONS)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await handle(request, request.app[GATEWAY], "chat/completions", COMPLETIONS)


def hot_routes(gw: Gateway) -> dict[tuple[str, str], Callable]:
    """The endpoints of this module for the server's own route table (``fastpath``)."""
    return {("POST", "/v1/completions"): partial(handle, gw=gw, endpoint="completions", api=COMPLETIONS),
            ("POST", "/v1/chat/completions"): partial(handle, gw=gw, endpoint="chat/completions", api=COMPLETIONS)}


def read_answer(call: Call, record: RequestRecord, answer: dict) -> None:
    """Usage and the last choice's finish reason, from a completion's JSON answer (its counts capped
    as the row's are)."""
    usage = answer.get("usage")
    if isinstance(usage, dict):
        cap_counts(usage)
        record.usage = Usage.from_upstream(usage)
    choices = answer.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[-1], dict):
        record.finish_reason = choices[-1].get("finish_reason")


COMPLETIONS = Api(checks=_checks, relay=relay_stream, read_answer=read_answer)
