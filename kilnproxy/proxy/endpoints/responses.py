"""POST /v1/responses (OpenAI's Responses API): its part of the request's path (``request_path``).

What differs from a completion: a request may not ask for ``background`` (its answer is read from
``GET /v1/responses/{id}``, which the gateway does not serve); the hold's completion part is
``max_output_tokens``, and a follow-up of a stored response or conversation may fill the window
with its prompt; the usage is the answer's ``usage`` object (``api_steps.read_usage``), the
finish reason its ``status``; a stream keeps its ``event:`` framing (``api_steps.relay``).
"""

from __future__ import annotations

from ...call import Call
from ...errors import bad_request
from ...store.limits import Hold, output_bound
from .. import rules
from ..request_path import Api
from ..request_record import RequestRecord
from ..upstream.routes import Route
from .api_steps import read_usage, relay


def checks(body: dict, call: Call, route: Route) -> None:
    rules.check_stream(body, call)
    if body.get("background") not in (None, False):
        # answered at once, its answer read later from GET /v1/responses/{id}: neither served nor metered here
        raise bad_request("`background` responses are not supported: the gateway does not serve GET "
                          "/v1/responses/{id}, where their answer is read.", param="background",
                          code="unsupported_parameter")


def hold(call: Call, created_at: str, body: dict, context_window: int | None) -> Hold:
    """The most the request can cost: ``max_output_tokens`` caps the output, and a follow-up of a stored
    response or conversation may fill the window with its prompt."""
    limit = body.get("max_output_tokens")
    completion = output_bound(limit if type(limit) is int and limit >= 0 else None, context_window)
    # a follow-up's prompt is the stored conversation the server prepends: up to the whole window
    stored = context_window if body.get("previous_response_id") or body.get("conversation") else None
    return Hold(call, created_at, body, context_window, completion, prompt=stored or None)


def read_answer(call: Call, record: RequestRecord, answer: dict) -> None:
    """Usage, the ``status`` as the finish reason, and a ``failed`` response's ``error.code`` (else
    ``upstream_error``) as the error code, as its stream's ``response.failed`` gives it."""
    read_usage(call, record, answer)
    status = answer.get("status")
    if isinstance(status, str):
        record.finish_reason = status
    if status == "failed":
        error = answer.get("error")
        code = error.get("code") if isinstance(error, dict) else None
        record.error_code = code if isinstance(code, str) else "upstream_error"


RESPONSES = Api(checks=checks, relay=relay, read_answer=read_answer, hold=hold)
