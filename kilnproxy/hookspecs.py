"""The plugin hooks of kilnproxy: their docstrings are the contract.

A plugin is a module (or object) with functions marked ``@hookimpl``
(``from kilnproxy import hookimpl``), named as below. It may accept any
subset of a hook's arguments, by name. A misspelled hook name or argument
stops start-up with one line naming the plugin.

Order: for one request the hooks run in this order::

    check_request -> rewrite_request -> (upstream answers) -> response_headers
      -> transform_event (each streamed event) | transform_response (JSON answer)
      -> (usage row committed) -> record_usage

Within one hook, plugins run in pluggy's order: the built-ins of
``kilnproxy.plugins.builtin`` first (they are ``tryfirst``), then the most
recently registered plugin first: ``[plugins] modules`` in reverse order of
the list, then entry-point plugins. ``@hookimpl(tryfirst=True)`` or
``trylast=True`` moves an implementation. Hook wrappers are not supported.

``call`` is a ``kilnproxy.Call``, one per request: ``generation_id``, ``org``,
``key_id``, ``model`` (catalog id), ``endpoint`` (``"completions"`` or
``"chat/completions"``), ``stream``, ``include_usage`` (what the client
asked), ``upstream_model``, ``upstream`` (the base URL chosen, once known),
``pricing``, ``state`` (a dict that lives as long as the request, for the
plugins' own use: compute something once in ``rewrite_request``, use it in
``transform_event``), and ``settings(name)``. ``call`` is read-only: assigning
to (or deleting) an attribute raises ``AttributeError``, the hook's error;
what a plugin may change is what ``call.state`` holds.

Settings: ``call.settings("<name>")`` (in request hooks) and
``gateway.plugin_settings("<name>")`` (in ``startup``/``shutdown``) return the
config's ``[plugins.settings.<name>]`` table as a dict (empty when absent;
shared by every request, so treat it as read-only). By convention ``<name>`` is the plugin's own name: the file's
stem for ``plugins/redact.py``, the last part of a dotted module, the entry
point's name. Check settings in ``startup`` and raise there, so that a bad
value stops start-up instead of failing requests.

Errors: a hook that raises fails only the request it ran for, and the
gateway's log gets the traceback. Before the response has started
(``check_request``, ``rewrite_request``, ``response_headers``,
``transform_response``) the client gets a 500 JSON error, code
``plugin_error``, whose message names the plugin and the hook. Once a stream
has started (``transform_event``) the client gets one ``data: {"error":
...}`` event with the same code and message, then ``data: [DONE]``. Either
way the request's usage row records ``error_code = "plugin_error"`` (with
the status sent: 500, or 200 for a started stream), its in-flight slot is
released, and the next request is served normally. ``startup``, ``shutdown``
and ``record_usage`` run outside any request; their errors are described
below. Raising ``kilnproxy.Refusal(status, code, message)`` from a hook that
runs before the response has started is not an error: it answers the request
with that JSON error (see ``check_request``).

Cost: the gateway looks the implementations of every hook up once, at
start-up. A hook that no plugin implements is never called: it costs nothing.
``transform_event`` is the only hook called per streamed event; every other
hook runs at most once per request. Every hook but ``transform_event`` may be
``async def``; the gateway awaits it.
"""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("kilnproxy")
hookimpl = pluggy.HookimplMarker("kilnproxy")


@hookspec
def startup(gateway):
    """Called once when the gateway starts, before it accepts requests.

    ``gateway`` is the running ``kilnproxy.proxy.gateway.Gateway``: the usage
    database is open and ``gateway.session`` (an ``aiohttp.ClientSession``
    for a plugin's own HTTP calls; requests to the model servers go through
    the gateway's own client) exists. Use ``gateway.config`` (the parsed
    config; ``gateway.config.resolve(path)`` makes a path relative to the
    config file) and ``gateway.plugin_settings(name)``. Open connections or
    files here, and check your settings. May be ``async def``.

    Raising stops start-up: ``python -m kilnproxy`` prints one line,
    ``kilnproxy: error: plugin '<name>': startup failed: <error>``, and exits
    with status 2. The plugins already started get their ``shutdown``.
    Return value ignored.
    """


@hookspec
def shutdown(gateway):
    """Called once when the gateway stops, after the last request has ended,
    the usage ledger is flushed and every ``record_usage`` call has returned.

    Close what ``startup`` opened. Called for every plugin whose ``startup``
    returned (or that has none), also when another plugin's ``startup`` failed.
    May be ``async def``. An exception is logged with the plugin's name and
    does not stop the other plugins' ``shutdown``. Return value ignored.
    """


@hookspec
def check_request(call, body):
    """Refuse a request before it goes upstream, or let it through.

    Called once per request to /v1/completions or /v1/chat/completions, after
    authentication, credits, the body rules and the in-flight limit (docs/reference.md:
    the request rules; ``call.model``, ``call.stream`` and ``call.include_usage`` are
    known), before ``rewrite_request``. ``body`` is the client's parsed JSON
    body with ``stream`` a real boolean; read it, do not change it here.

    Return ``None`` to let the request go on, or a
    ``kilnproxy.Refusal(status, code, message, param=None, type=...,
    headers=None)`` to answer it with that JSON error instead (raising the
    ``Refusal`` does the same). The first refusal wins: later plugins are not
    called. Nothing is sent upstream; the usage row records that status and
    code, with no tokens. Any other return value is a ``plugin_error``.
    May be ``async def``.
    """


@hookspec
def rewrite_request(call, body):
    """Change the body that goes upstream, in place.

    Called once per request, after ``check_request``, just before the body is
    sent upstream. ``body`` is a dict: the client's body with ``stream`` made a
    real boolean. The built-in plugin has already replaced ``model`` with
    ``call.upstream_model`` and, on streamed requests, set
    ``stream_options.include_usage = true`` (the gateway needs the usage
    chunk to meter the request); keep both. Every other field, known or not,
    is yours to change, add or remove; ``prompt`` may be a string, a list of
    strings, or token ids. May raise a ``kilnproxy.Refusal``. May be
    ``async def``. Return value ignored.
    """


@hookspec
def transform_event(call, event):
    """Change one streamed event, in place, before the client gets it.

    Called for each ``data:`` event of a streamed answer that the client will
    receive, parsed into a dict, with ``model`` already set to the catalog
    id: every chunk, then last the usage chunk (``choices: []``, ``usage``
    with ``cost`` added) when the client asked for ``include_usage``. Not
    called for error events, SSE comments or ``[DONE]``.

    Return ``kilnproxy.STOP`` to end the stream after this event: the client
    gets this event, then the usage chunk (if it asked for it; the counts are
    then the gateway's estimate, as for a client that left early) and
    ``data: [DONE]``; the upstream request is closed at once so the model
    server stops generating; the usage row's ``finish_reason`` is the one
    this event ends with (set ``choice["finish_reason"] = "stop"`` when you
    stop). Return ``kilnproxy.DROP`` to leave this event out (the usage
    chunk too). Any other return value is ignored. When several plugins
    answer, the first ``STOP`` or ``DROP`` wins, and every plugin still sees
    the event.

    Must be a plain function (``async def`` is refused at start-up). It runs
    on the hot path, once per generated token: keep it cheap, and prepare in
    ``rewrite_request`` (into ``call.state``) what can be prepared once.
    When at least one plugin implements this hook, every event is parsed
    and re-serialised; when none does, events nobody else changes are
    forwarded as the upstream's own bytes. An exception (or an event left
    holding something that is not JSON) ends the stream with an ``error``
    event naming the plugin.
    """


@hookspec
def transform_response(call, body):
    """Change a non-streamed answer (a dict), in place, before the client gets it.

    Called once per non-streamed request whose upstream answered 2xx, after
    ``model`` has been set to the catalog id and ``usage.cost`` added (so
    ``body["usage"]`` is what the usage row records; changing it changes
    what the client sees, not the row). Not called for upstream errors
    (400/422 pass through unchanged; others become 502). May raise a
    ``kilnproxy.Refusal`` to send that error instead (the tokens are still
    charged: the upstream did the work). May be ``async def``. Return value
    ignored.
    """


@hookspec
def response_headers(call):
    """Return extra headers for the response: a dict of str to str, or ``None``.

    Called once per request whose upstream has answered (with its status and
    headers, before its body is read), so ``call.upstream`` is known; before
    the response to the client starts. The headers go on the response the
    upstream's answer becomes: the stream, the JSON answer, or a
    passed-through 400/422. Responses the gateway makes itself (refusals,
    401-429, 502, 503) carry only the gateway's headers.
    ``X-Neocloud-Generation-Id`` cannot be replaced. A name must be an HTTP
    token the gateway does not own (any case: the id, ``Content-Type`` and the
    framing headers, ``kilnproxy.answers.GATEWAY_OWNED``), a value free of
    control characters; else the request's 500 ``plugin_error``. The same
    holds for a ``Refusal``'s headers, and its status must be an int from 400
    to 599. When several plugins set the same header, the last to run wins.
    May be ``async def``.
    """


@hookspec
def record_usage(call, usage):
    """See the usage row of a request after it has been committed.

    ``usage`` is a read-only mapping with the columns of the ``usage_events``
    table (usage accounting (docs/reference.md): ``id``, ``org``, ``model``, ``status``,
    ``error_code``, token counts, ``cost``, ``finish_reason``,
    ``disconnected``, ...). Called exactly once per row, every way a request
    can end (errors, 429s, refusals and client disconnects included), once
    the row is in SQLite. It runs in one background task, off the request's
    path, in commit order: a slow implementation delays other ``record_usage``
    calls, never a response; at shutdown the gateway waits for the calls
    still queued. May be ``async def``. An exception is logged with the
    plugin's name; the row stays written and the next row is delivered.
    Return value ignored.
    """
