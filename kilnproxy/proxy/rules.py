"""The request rules (docs/reference.md), steps 1 to 7, one function each, called in order
by ``request_path.handle`` for every API (step 3, the body, is ``kilnproxy.proxy.request_body``).

Each check raises ``GatewayError`` with the status and code docs/reference.md gives;
the first that fails answers the request.
"""

from __future__ import annotations

from typing import Awaitable

from ..config import KeyConfig, MaintenanceConfig
from ..errors import GatewayError, bad_request, forbidden, model_not_found
from ..call import Call, set_stream
from ..store.tenancy.key_usage import period_start
from ..store.limits import Admission, Credits, Hold, insufficient_credits
from ..usage import MAX_CHOICES
from .tenancy.auth import check_enabled
from .request_body import read_json_body  # step 3  # noqa: F401 (called as rules.read_json_body, beside the other steps)
from .upstream.routes import Route

_TRUE = ("true",)
_FALSE = ("false",)


def check_account(key: KeyConfig, disabled_orgs: frozenset[str], credits: Credits,
                  maintenance: MaintenanceConfig) -> None:
    """Steps 1 and 2, once the key is known: 403 disabled key or org, 402 no credits, 503 maintenance."""
    check_enabled(key, disabled_orgs)
    if credits.remaining(key.org) <= 0:
        raise insufficient_credits(key.org)
    if maintenance.enabled:
        raise GatewayError(503, "maintenance", "The gateway is in maintenance mode.",
                           type="service_unavailable", headers={"Retry-After": maintenance.retry_after})


def take_slot(admission: Admission, hold: Hold, limit: int, key: KeyConfig,
              org_per_minute: tuple[int | None, int | None] | None = None) -> Awaitable[None]:
    """Step 5 (to await): the org's in-flight slot and the hold on its credits (and on the key's ``limit``),
    in one step: 429 when the org already has ``limit`` requests in flight (no rate-limit
    headers), 402 ``insufficient_credits`` when its credits minus its other holds are used up,
    402 ``key_limit_exceeded`` when the key's limit minus its usage in the period and its other
    holds is; 429 ``rate_limit_exceeded`` too when the org (``org_per_minute``) or the key has
    admitted its ``requests_per_minute``, or used and reserved its ``tokens_per_minute``, over the
    last 60 s. From here on the slot and hold are released when the request's row is submitted
    (``Gateway.submit``), whatever happens."""
    if key.limit is not None:
        hold.key_limit, hold.key_since = key.limit, period_start(key.limit_reset, key.created_at)
    if org_per_minute is not None:
        hold.per_minute.append((f"org:{key.org}", *org_per_minute))
    if key.requests_per_minute is not None or key.tokens_per_minute is not None:
        hold.per_minute.append((f"key:{key.id}", key.requests_per_minute, key.tokens_per_minute))
    return admission.admit(hold, limit)


def check_model(body: dict, key: KeyConfig, routes: dict[str, Route]) -> Route:
    """Step 4: 404 for a model not in the catalog, 403 for one outside the key's allow-list."""
    route = routes.get(body["model"])
    if route is None:
        raise model_not_found(body["model"])
    if key.models is not None and route.id not in key.models:
        raise forbidden(f"This key may not use model `{route.id}`.")
    return route


def check_endpoint(route: Route, endpoint: str) -> None:
    """Step 4 too: a model answers only the endpoints its ``endpoints`` lists; another -> 404."""
    if endpoint not in route.endpoints:
        raise model_not_found(route.id)


def check_stream(body: dict, call: Call) -> None:
    """Step 6: coerce ``stream`` to a boolean and check ``stream_options`` (sets ``call.stream``)."""
    value = body.get("stream")
    if value is True or value in _TRUE or (type(value) is int and value == 1):
        stream = True
    elif value is None or value is False or value in _FALSE or (type(value) is int and value == 0):
        stream = False
    else:
        raise bad_request("`stream` must be true or false (\"true\", 1, \"false\", 0 and null are accepted).",
                          param="stream")
    if "stream" in body:
        body["stream"] = stream
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise bad_request("`stream_options` can only be given together with `stream: true`.",
                              param="stream_options")
        if not isinstance(options, dict):
            raise bad_request("`stream_options` must be an object.", param="stream_options")
    set_stream(call, stream, stream and isinstance(options, dict) and options.get("include_usage") is True)


def check_choices(body: dict) -> None:
    """Step 6 too, on the completion endpoints: ``n`` and ``best_of``, which the hold counts (``choice_count``),
    are null or a whole number from 1 to ``MAX_CHOICES`` (``2.0`` is 2), else 400 naming the field. vLLM reads
    ``"2"`` as 2 choices: the hold cannot count what a server will make of a value that is not a number; and
    a hold of more choices than any server makes at once is beyond what the stores count (64 bits)."""
    for name in ("n", "best_of"):
        value = body.get(name)
        if value is None or (type(value) is int and 1 <= value <= MAX_CHOICES):
            continue
        if type(value) is float and value.is_integer() and 1 <= value <= MAX_CHOICES:
            continue
        raise bad_request(f"`{name}` must be an integer from 1 to {MAX_CHOICES}, not {_shown(value)}.", param=name)


def _shown(value: object) -> str:
    text = repr(value) if isinstance(value, (int, float, str)) else type(value).__name__
    return text if len(text) <= 40 else text[:40] + "…"


def check_chat_params(body: dict, call: Call, route: Route) -> None:
    """Step 7: a parameter the model refuses on /chat/completions -> 400 unsupported_parameter."""
    if call.endpoint != "chat/completions" or not route.reject_chat_params:
        return
    for name in route.reject_chat_params:
        if name in body:
            raise bad_request(f"`{name}` is not supported on /chat/completions for model `{route.id}`.",
                              param=name, code="unsupported_parameter")
