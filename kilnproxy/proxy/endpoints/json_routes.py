"""What every route of the gateway shares, so that no request is answered outside its JSON errors.

aiohttp answers two things before any middleware runs, with its own
``text/plain`` bodies: an ``Expect`` header other than ``100-continue`` (417,
and a dropped connection when the value is not UTF-8), and a path or method
that no route serves (404, 405). Here:

* ``expect_handler``, given to every route: ``100-continue`` is honoured; any
  other expectation is ignored, as RFC 9110 allows, so the request goes on and
  gets its usual answer (and, on the completion endpoints, its usage row);
* ``add_fallback``: one last route that matches everything else and answers
  404 ``not_found`` or 405 ``method_not_allowed`` (with ``Allow``) as JSON
  (in Anthropic's form under ``/v1/messages``).
"""

from __future__ import annotations

from aiohttp import web
from aiohttp.http import HttpVersion11

from ...errors import GatewayError
from ..relay.anthropic_errors import anthropic_error_response

MESSAGES = "/v1/messages"


async def expect_handler(request: web.Request) -> None:
    if request.version == HttpVersion11 and request.headers.get("Expect", "").lower() == "100-continue":
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the answer itself has not started


def add_fallback(app: web.Application) -> None:
    """Call last, once every other route is in place."""
    # [\s\S], not ".": a path may hold a newline (%0A), which "." would leave to aiohttp's own 404
    fallback = app.router.add_route("*", r"/{unrouted:[\s\S]*}", _unrouted, expect_handler=expect_handler)
    app[_FALLBACK] = fallback.resource


async def _unrouted(request: web.Request) -> web.StreamResponse:
    allowed: set[str] = set()
    for resource in request.app.router.resources():
        if resource is not request.app[_FALLBACK]:
            match, methods = await resource.resolve(request)
            allowed |= methods
    if allowed:
        err = GatewayError(405, "method_not_allowed", "Method Not Allowed", headers={"Allow": ",".join(sorted(allowed))})
    else:
        err = GatewayError(404, "not_found", "Not Found")
    if request.path.startswith(MESSAGES):  # Anthropic's clients read Anthropic's errors
        return anthropic_error_response(err)
    raise err


_FALLBACK = web.AppKey("fallback_resource", web.AbstractResource)
