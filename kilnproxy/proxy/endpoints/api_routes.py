"""The routes of the APIs beside completions: POST /v1/embeddings, /v1/responses, /v1/messages and
/v1/messages/count_tokens, each to its module's ``Api`` (``embeddings``, ``responses``, ``messages``)."""

from __future__ import annotations

from functools import partial
from typing import Callable

from aiohttp import web

from .. import request_path
from ..gateway import GATEWAY, Gateway
from .embeddings import EMBEDDINGS
from .messages import COUNT_TOKENS, MESSAGES, count_tokens_route
from .responses import RESPONSES

PATHS = {"/v1/embeddings": "embeddings", "/v1/responses": "responses", "/v1/messages": "messages",
         "/v1/messages/count_tokens": COUNT_TOKENS}
APIS = {"embeddings": EMBEDDINGS, "responses": RESPONSES, "messages": MESSAGES}


def add_routes(app: web.Application, expect_handler) -> None:
    """The router's routes: what the server's own table (``hot_routes``) does not take comes here (a query
    string, an escaped path, an ``Expect`` header)."""
    for path, endpoint in PATHS.items():
        app.router.add_post(path, partial(_route, endpoint=endpoint), expect_handler=expect_handler)


def hot_routes(gw: Gateway) -> dict[tuple[str, str], Callable]:
    """The endpoints of these APIs for the server's own route table (``fastpath``), as completions'."""
    return {("POST", path): partial(handle, gw=gw, endpoint=endpoint) for path, endpoint in PATHS.items()}


async def _route(request: web.Request, endpoint: str) -> web.StreamResponse:
    return await handle(request, request.app[GATEWAY], endpoint)


async def handle(request: web.BaseRequest, gw: Gateway, endpoint: str) -> web.StreamResponse:
    if endpoint == COUNT_TOKENS:
        return await count_tokens_route(request, gw)
    return await request_path.handle(request, gw, endpoint, APIS[endpoint])
