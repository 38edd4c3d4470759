"""The small endpoints: catalog, credits, the caller's key, generations, liveness (docs/reference.md)."""

from __future__ import annotations

import orjson
from aiohttp import web

from ...answers import Answer
from ...config import KeyConfig, ModelConfig
from ...errors import GatewayError, invalid_api_key, model_not_found
from ...usage import round_usd
from ..tenancy.auth import check_enabled, either_header
from ..gateway import GATEWAY
from ..tenancy.changes import answer_store_trouble
from ..tenancy.views import gateway_view


def json_response(data: object, status: int = 200) -> Answer:
    return Answer(orjson.dumps(data), status)


def authorized_key(request: web.Request) -> KeyConfig:
    gw = request.app[GATEWAY]
    key = gw.keys.authenticate(either_header(request.headers))  # a bearer, or Anthropic's x-api-key
    check_enabled(key, gw.disabled_orgs)
    return key


def model_card(model: ModelConfig, created: int) -> dict:
    pricing = model.pricing
    return {
        "id": model.id,
        "object": "model",
        "created": created,
        "owned_by": "kilnproxy",
        "context_window": model.context_window,
        "endpoints": list(model.endpoints),
        "pricing": {
            "prompt": pricing.prompt,
            "completion": pricing.completion,
            "cached_prompt": pricing.prompt if pricing.cached_prompt is None else pricing.cached_prompt,
        },
    }


def catalog(gw) -> tuple[ModelConfig, ...]:
    """The models served now: the config's, and those its ``discover = true`` entries found."""
    return tuple(route.model for route in list(gw.routes.values()))


def visible_models(key: KeyConfig, models: tuple[ModelConfig, ...]) -> list[ModelConfig]:
    return [m for m in models if key.models is None or m.id in key.models]


async def list_models(request: web.Request) -> web.Response:
    key = authorized_key(request)
    gw = request.app[GATEWAY]
    cards = [model_card(m, gw.started_at) for m in visible_models(key, catalog(gw))]
    return json_response({"object": "list", "data": cards})


async def get_model(request: web.Request) -> web.Response:
    key = authorized_key(request)
    gw = request.app[GATEWAY]
    model_id = request.match_info["model_id"]
    for model in visible_models(key, catalog(gw)):
        if model.id == model_id:
            return json_response(model_card(model, gw.started_at))
    raise model_not_found(model_id)


async def credits(request: web.Request) -> web.Response:
    key = authorized_key(request)
    gw = request.app[GATEWAY]
    granted = gw.credits.granted.get(key.org, 0.0)
    spent = await gw.spent(key.org)
    return json_response({"org": key.org, "granted": granted, "spent": round_usd(spent),
                          "remaining": round_usd(granted - spent)})


async def own_key(request: web.Request) -> web.Response:
    """``GET /v1/key``: the caller's own key object (no envelope, never the secret)."""
    key = authorized_key(request)
    with answer_store_trouble():
        found = await gateway_view(request.app[GATEWAY]).key(key.id)
    if found is None or found["revoked"]:  # revoked by another replica this very second
        raise invalid_api_key()
    return json_response(found)


async def generation(request: web.Request) -> web.Response:
    key = authorized_key(request)
    generation_id = request.match_info["generation_id"]
    row = await request.app[GATEWAY].ledger.get(generation_id)
    if row is None or row["org"] != key.org:
        raise GatewayError(404, "generation_not_found",
                           f"No generation `{generation_id}` for this organization.", param="id")
    return json_response(row)


async def healthz(request: web.Request) -> web.Response:
    """Liveness: always 200 while the process serves. ``?ready``: 503 while the shared store is out
    of reach, and from a graceful shutdown's first moment (a load balancer then sends new requests
    to another replica while this one still answers what reaches it)."""
    gw = request.app[GATEWAY]
    available = gw.ledger.available
    body = {"status": "ok", "store": "up" if available else "down"}
    if gw.draining:
        body["draining"] = True
    if "ready" in request.query and (not available or gw.draining):
        return json_response({**body, "status": "not_ready"}, status=503)
    return json_response(body)
