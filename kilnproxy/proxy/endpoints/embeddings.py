"""POST /v1/embeddings: its part of the request's path (``request_path``).

The same path as a completion: key, account, body, model (and the endpoints it serves), slot and
hold, plugins, upstream, one usage row whatever way the request ends. What differs: the body's
``input`` is checked (``embedding_input``); the hold is the input's only (embeddings produce no
tokens, and each input of a batch may fill the context window); the usage is the answer's own
object (``api_steps.read_usage``), and there is no finish reason.
"""

from __future__ import annotations

from ...call import Call
from ...store.limits import Hold
from ...usage import input_count
from ..request_path import Api
from ..request_record import RequestRecord
from ..upstream.routes import Route
from .api_steps import read_usage, relay
from .embedding_input import check_embeddings


def checks(body: dict, call: Call, route: Route) -> None:
    check_embeddings(body)


def hold(call: Call, created_at: str, body: dict, context_window: int | None) -> Hold:
    """The most the request can cost: no output, and the window bounds each input of a batch."""
    return Hold(call, created_at, body, context_window, 0, input_count(body))


def read_answer(call: Call, record: RequestRecord, answer: dict) -> None:
    read_usage(call, record, answer)


EMBEDDINGS = Api(checks=checks, relay=relay, read_answer=read_answer, hold=hold)
