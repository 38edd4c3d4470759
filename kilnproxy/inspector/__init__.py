"""The inspector: a live view of the gateway in the browser, at ``/ui``; and the org admins' portal,
at ``/portal/``.

* ``queries``: reads of the usage ledger (pages of requests, one request, usage buckets), on
  SQLite or on the shared PostgreSQL store: the API's parameters parsed, the SQL, the tables and the
  SQLite reader the store's (``kilnproxy.store.inspector_tables``, ``kilnproxy.store.sqlite.inspector_reader``);
* ``hub``: committed rows fanned out to the page's live feed (SSE);
* ``replica_feed``: on PostgreSQL, the rows the other replicas commit, into the hub;
* ``capture``: the opt-in ring of request bodies and both streams;
* ``api``: access rule, the page's files and the JSON API (docs/inspector.md);
* ``tenancy``: the JSON side of the "Orgs & keys" page (balances, keys, grants; create, revoke, grant);
* ``upstreams``: the JSON of the "Upstreams" page (each model's upstreams: prompt-cache hit rate and load);
* ``batches``: the JSON side of the "Batches" page (every org's batches, their status, counts, progress);
* ``static/``: the page itself, plain HTML and JavaScript, with Chart.js vendored, and ``money.js``, the
  one way every page writes money;
* ``portal``: the org admins' page at ``/portal/`` (its files in ``portal_static/``, with ``money.js``
  and Chart.js shared from ``static/``), which reads and changes one org through the org API
  (``/v1/org``) with an admin key; it serves files only, no data.

``setup_inspector(app, gateway)`` adds all of it to the gateway's app: the portal always (its files
hold nothing; the org API answers for each org), the inspector unless ``[inspector] enabled = false``.
``fallback_headers(path)``: the pages' security headers, for the app's own error answers under ``/ui``
and ``/portal``.

May import: ``batches``, ``proxy`` and everything below them; not ops, the web app or the CLI.
"""

from __future__ import annotations

from aiohttp import web

from ..proxy.gateway import Gateway
from .api import InspectorAPI, fallback_headers
from .capture import CaptureRing
from .hub import LiveHub
from .portal import PortalPages
from ..store.sqlite.inspector_reader import SQLiteReader
from .queries import InspectorStore, SharedReader
from .replica_feed import ReplicaFeed

__all__ = ["fallback_headers", "setup_inspector"]


def setup_inspector(app: web.Application, gateway: Gateway) -> None:
    app.router.add_routes(PortalPages().routes())
    config = gateway.config.inspector
    if not config.enabled:
        return
    if config.capture:
        gateway.capture = CaptureRing(config.capture_requests, config.capture_bytes)
    hub = LiveHub(gateway.capture)
    if gateway.capture is not None:
        gateway.capture.on_start = hub.started
    shared = gateway.config.storage.url is not None  # PostgreSQL: read every replica's rows through its pool
    reader = SharedReader(gateway.ledger) if shared else SQLiteReader(gateway.config.db_path)
    store = InspectorStore(reader)
    file_users = None if shared else gateway.ledger.file_users  # the SQLite ledger's
    feed = None
    if shared:  # one process on SQLite sees every row it commits; replicas tell each other theirs
        gateway.ledger.tell_rows = True
        feed = ReplicaFeed(gateway.ledger, hub)
    api = InspectorAPI(gateway, store, hub)
    app.router.add_routes(api.routes())

    async def lifetime(app: web.Application):
        await store.open()  # after the gateway's own start: the ledger has made the table
        if file_users is not None:  # closed and opened again with the ledger's if its files are deleted
            file_users.append(reader)
        gateway.commit_listeners.append(hub.publish)
        if feed is not None:
            await feed.start()
        yield
        if feed is not None:
            await feed.stop()
        gateway.commit_listeners.remove(hub.publish)
        if file_users is not None:
            file_users.remove(reader)
        await store.close()

    async def on_shutdown(app: web.Application) -> None:
        hub.close()  # end the live feeds now: they are requests in progress that would never end

    app.cleanup_ctx.append(lifetime)
    app.on_shutdown.insert(0, on_shutdown)  # before the grace period waits for requests in progress
