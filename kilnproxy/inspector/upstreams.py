"""The inspector's upstreams view (``GET /ui/api/upstreams``): each model's upstreams, their
prompt-cache hit rate and their load, from what ``/metrics`` reads.

``upstreams_view(gateway, now)`` is ``{"data": [...]}``, one entry per model and upstream:

* the configured ones first, in the config's order (each model's upstreams as listed): ``model``,
  ``routing``, ``upstream`` (the URL as written, userinfo removed, as the usage rows' column), ``up``
  (not marked down), ``load`` (SPEC 13's load as routing last read it: the larger of this
  replica's requests in flight to the URL and the server's own count; ``kilnproxy_upstream_load``);
* then any model and upstream that served requests but is no longer configured (a reload removed
  it), with ``routing``, ``up`` and ``load`` null;
* each with ``prompt_tokens`` and ``cached_tokens``, as the upstream reported them for this
  model's requests since this process started (``Gateway.upstream_tokens``, which
  ``kilnproxy_upstream_prompt_tokens_total`` and ``kilnproxy_upstream_cached_tokens_total`` count
  too), and ``hit_rate``, cached over prompt (null before any prompt token).

Like ``/metrics``, the figures are this replica's (other replicas count their own requests).
"""

from __future__ import annotations

from ..proxy.gateway import Gateway
from ..proxy.request_record import shown_url


def upstreams_view(gateway: Gateway, now: float) -> dict:
    """The view's JSON at ``now`` (monotonic seconds)."""
    counts = gateway.upstream_tokens.counts
    data, listed = [], set()
    for route in list(gateway.routes.values()):
        for u in route.upstreams:
            url = shown_url(u.base_url)
            listed.add((route.id, url))
            data.append(_entry(route.id, route.routing, url, u.is_up(now), u.slots.load_at(now),
                               counts.get((route.id, url))))
    for (model, url), tokens in list(counts.items()):
        if (model, url) not in listed:
            data.append(_entry(model, None, url, None, None, tokens))
    return {"data": data}


def _entry(model: str, routing: str | None, url: str, up: bool | None, load: int | None,
           tokens: list[int] | None) -> dict:
    prompt, cached = tokens if tokens is not None else (0, 0)
    return {"model": model, "routing": routing, "upstream": url, "up": up, "load": load,
            "prompt_tokens": prompt, "cached_tokens": cached, "hit_rate": cached / prompt if prompt else None}
