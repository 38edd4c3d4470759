"""The plugin hooks of kilnproxy: their docstrings are the contract.

A plugin is a module (or object) with functions marked ``@hookimpl``, named as
below. It may accept any subset of a hook's arguments, by name. Hooks run in
pluggy's order (last registered first; ``@hookimpl(tryfirst=True)`` /
``trylast=True`` to move); the built-in plugins of ``kilnproxy.default_plugins``
run first.

``call`` is a ``kilnproxy.Call``: ``generation_id``, ``org``, ``key_id``,
``model`` (catalog id), ``endpoint`` (``"completions"`` or
``"chat/completions"``), ``stream``, ``include_usage`` (what the client asked),
``upstream_model``, ``upstream`` (the base URL chosen, once known), ``state``
(a dict that lives as long as the request, for the plugin's own use), and
``settings(name)``, which returns the ``[plugins.settings.<name>]`` table of the
config as a dict (empty when absent).

Errors: a hook that raises fails only the request it ran for. Before the
response has started the client gets a 500 JSON error with code
``plugin_error`` naming the plugin; once a stream has started, an ``error``
event naming the plugin and ``data: [DONE]``. The usage row and the in-flight
slot are handled as for any other failure, and the gateway keeps serving.

Cost: hooks that no plugin implements are never called; the gateway looks the
implementations up once, at start-up. ``transform_event`` is the only hook
called per streamed event; everything else runs at most once per request.
"""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("kilnproxy")
hookimpl = pluggy.HookimplMarker("kilnproxy")


@hookspec
def startup(gateway):
    """Called once when the gateway starts, after the database is open.

    ``gateway`` is the running ``kilnproxy.gateway.Gateway``; use
    ``gateway.config`` and ``gateway.plugin_settings(name)``. Open connections
    or files here. May be ``async def``. Raising stops start-up with one line
    naming the plugin.
    """


@hookspec
def shutdown(gateway):
    """Called once when the gateway stops, after the last request has ended and
    the usage ledger is flushed. Close what ``startup`` opened. May be
    ``async def``. Exceptions are logged and do not stop the other plugins.
    """


@hookspec
def check_request(call, body):
    """Answer or refuse a request before it goes upstream.

    Called once per request, after authentication, the body rules and the
    in-flight limit, before ``rewrite_request``. ``body`` is the client's
    parsed JSON body (do not change it here). Return ``None`` to let the
    request go on, or a ``kilnproxy.Refusal(status, code, message)`` to answer
    it with that JSON error instead (the request is recorded with that status
    and code, and nothing is sent upstream). The first refusal wins. May be
    ``async def``.
    """


@hookspec
def rewrite_request(call, body):
    """Change the body that goes upstream, in place.

    Called once per request, just before it is sent. ``body`` is a dict: the
    client's body with ``stream`` made a real boolean. The built-in plugin has
    already replaced ``model`` with the upstream's name and forced
    ``stream_options.include_usage`` on streamed requests; keep both. Return
    value ignored. May be ``async def``.
    """


@hookspec
def transform_event(call, event):
    """Change one streamed event, in place, before the client gets it.

    Called for each ``data:`` event the client will receive, parsed into a
    dict: every chunk, and the usage chunk (``choices: []``) after ``cost`` has
    been added. Not called for error events, comments or ``[DONE]``. Must be a
    plain (synchronous) function: it runs on the hot path, once per token, so
    keep it cheap. When at least one plugin implements it, every event is
    parsed and re-serialised; when none does, events are forwarded as the
    upstream's own bytes.

    Return ``kilnproxy.STOP`` to end the stream after this event: the
    gateway closes the upstream request, sends the usage chunk (if the client
    asked for it) and ``data: [DONE]``. Return ``kilnproxy.DROP`` to leave
    this event out. Any other return value is ignored.
    """


@hookspec
def transform_response(call, body):
    """Change a non-streamed response body (a dict), in place.

    Called once, after ``model`` has been set to the catalog id and
    ``usage.cost`` added. Only for successful (2xx) upstream answers. Must be
    a plain function. Return value ignored.
    """


@hookspec
def response_headers(call):
    """Return a dict of extra headers for the response, or ``None``.

    Called once per request that reaches the upstream stage, before the
    response headers are sent (streamed or not). Must be a plain function.
    """


@hookspec
def record_usage(call, usage):
    """See the usage row of a request after it has been committed.

    ``usage`` is a read-only mapping with the columns of the ``usage_events``
    table (SPEC section 7). Called exactly once per row, every way a request
    can end (errors, 429s and client disconnects included), after the row is
    in SQLite and off the request's path: a slow implementation delays other
    ``record_usage`` calls, never a response. May be ``async def``. Exceptions
    are logged with the plugin's name; the row stays written.
    """
