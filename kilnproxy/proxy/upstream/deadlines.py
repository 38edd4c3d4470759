"""A model's deadlines: ``first_byte_timeout`` (fail over) and ``request_timeout`` (give up).

``request_timeout`` counts from admission, time waiting for an upstream slot
included. Before anything reached the client, passing it answers 504
``upstream_timeout`` (``RequestDeadline.expired``); once an upstream answers,
``watch`` arms one timer on its response that ends the body with
``DeadlinePassed``: the stream relay turns that into an error event and
``[DONE]``, a non-streamed answer into the same 504. One timer per request,
never a timeout per chunk.
"""

from __future__ import annotations

import asyncio

import aiohttp

from ...errors import GatewayError
from .responses import UpstreamResponse


class DeadlinePassed(aiohttp.ClientError):
    """Set on an upstream response's body when the request's ``request_timeout`` has passed."""

    code = "upstream_timeout"

    def __init__(self) -> None:
        super().__init__("The request took longer than the model's request_timeout.")

    def error(self) -> GatewayError:
        """A non-streamed answer cut short: 504."""
        return GatewayError(504, self.code, str(self), type="timeout_error")


class RequestTimedOut(GatewayError):
    """``request_timeout`` passed before the answer began: 504, and no fallback is tried."""


def upstream_timeout(model: str, what: str, kind: type[GatewayError] = GatewayError) -> GatewayError:
    return kind(504, "upstream_timeout", f"Model `{model}`: {what}.", type="timeout_error")


def first_byte_missed(model: str, seconds: float) -> GatewayError:
    return upstream_timeout(model, f"no upstream began its answer within first_byte_timeout ({seconds:g} s)")


def request_deadline_passed(model: str, seconds: float) -> GatewayError:
    return upstream_timeout(model, f"the request took longer than request_timeout ({seconds:g} s)",
                            RequestTimedOut)


def deadline_of(admitted: float, seconds: float | None) -> float | None:
    """The loop time by which a request admitted at ``admitted`` must end (None: never)."""
    return None if seconds is None else admitted + seconds


def watch(resp: UpstreamResponse, deadline: float | None) -> asyncio.TimerHandle | None:
    """End ``resp``'s body with ``DeadlinePassed`` at ``deadline``; cancel the handle once done with it."""
    if deadline is None:
        return None
    loop = asyncio.get_running_loop()
    return loop.call_at(deadline, _expire, resp)


def _expire(resp: UpstreamResponse) -> None:
    if not resp.content.is_eof():
        resp.content.set_exception(DeadlinePassed())
