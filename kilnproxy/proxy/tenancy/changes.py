"""Changing orgs, keys and grants at runtime: the rules the admin API and the commands share.

Each change takes the request's body as parsed JSON and checks, in this
order, before anything is written (so a refused change changes nothing):

1. the body (``store.tenancy_validation``): 400 ``invalid_request`` naming ``param``;
2. the org or key it names exists, in the config or the store: else 404 ``not_found``;
3. it is not one of the config's (those are changed by editing the config
   and reloading): else 409 ``managed_by_config``. A config org still takes
   grants and runtime keys. Creating an org whose id exists (config or
   runtime) is 409 ``conflict``.

Then the store makes the change and its audit event (``actor``: who made it,
e.g. ``admin-api``, ``cli`` or ``key:<key id>``), ``after_change`` runs (a
gateway: refresh its in-memory orgs and keys, so the change is in force before
the answer), and the answer is the changed object as ``TenancyView`` shows it.

Scope: the operator's changes see every org (``org`` None). Those of an org's
own admin (the org API, ``org`` its id) see that org only: a key, event or
org of another is 404 ``not_found`` as if it did not exist (checked at step
2, before 409); the bodies take no ``org`` and no per-minute limit (400 naming
the field); grants and the orgs' own settings are refused (403); and a change
that would leave the org without an active admin key is 409 ``conflict``
(checked last, in the store's transaction: ``TenancyStore._keep_an_admin``).

``is_store_outage(exc)`` says whether an exception means the database is out
of reach (PostgreSQL down, a statement timed out, the SQLite file locked too
long); inside ``answer_store_trouble()`` such an exception becomes the HTTP
answer 503 ``store_unavailable``; a command prints one line instead.
"""

from __future__ import annotations

import asyncio
import sqlite3
import sys
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Iterator

from ...errors import GatewayError, forbidden
from ...store.tenancy import validation as bodies
from ...store.ledger import UNREACHABLE_MESSAGE, store_unavailable
from ...store.postgres.sqlstates import database_state
from .views import TenancyView, grant_object

if TYPE_CHECKING:
    from aiohttp import web


def query(request: web.Request, *allowed: str) -> dict[str, str]:
    """The query's parameters, or 400 naming one the route does not take (the admin API's and the
    inspector's tenancy routes)."""
    for name in request.query:
        if name not in allowed:
            raise bodies.invalid(f"Unknown query parameter `{name}`" + (
                f"; this route takes: {', '.join(allowed)}." if allowed else "; this route takes none."), name)
    return dict(request.query)


def not_found(what: str, id: str, param: str | None = None) -> GatewayError:
    return GatewayError(404, "not_found", f"No {what} `{id}`.", param=param)


def managed_by_config(what: str, id: str) -> GatewayError:
    return GatewayError(409, "managed_by_config",
                        f"The {what} `{id}` is in the gateway's config: change it there and reload "
                        "(SIGHUP or POST /admin/reload).")


def conflict(org_id: str) -> GatewayError:
    return GatewayError(409, "conflict", f"An org with id `{org_id}` already exists.", param="id")


def is_store_outage(exc: BaseException) -> bool:
    """True when ``exc`` says the database is out of reach or refuses statements now (read-only, a
    lock held, a full disk: ``kilnproxy.store.postgres.sqlstates``), not that the gateway has a bug."""
    if isinstance(exc, (OSError, asyncio.TimeoutError, sqlite3.OperationalError)):
        return True
    asyncpg = sys.modules.get("asyncpg")  # loaded only when a PostgreSQL store is configured
    if asyncpg is None:
        return False
    if isinstance(exc, asyncpg.PostgresError):
        return database_state(exc.sqlstate)
    return isinstance(exc, (asyncpg.InterfaceError, asyncpg.InternalClientError))


@contextmanager
def answer_store_trouble() -> Iterator[None]:
    """Turn a database out of reach into 503 ``store_unavailable``; anything else goes on up."""
    try:
        yield
    except Exception as exc:
        if not is_store_outage(exc):
            raise
        raise store_unavailable(UNREACHABLE_MESSAGE) from None


async def _nothing() -> None:
    return None


class TenancyChanges:
    """The changes of orgs, keys and grants, by ``actor``, on ``view``'s config and store; of ``org``'s
    keys only when it is given (an org's own admin)."""

    def __init__(self, view: TenancyView, actor: str,
                 after_change: Callable[[], Awaitable[Any]] = _nothing, org: str | None = None):
        self.view = view
        self.store = view.store
        self.actor = actor
        self.after_change = after_change
        self.scope = org
        # the query parameters that choose an org: the operator's listings only
        self.filters: tuple[str, ...] = ("org",) if org is None else ()

    # -- lookups with their 404 --

    def _in_scope(self, org_id: str) -> bool:
        return self.scope is None or org_id == self.scope

    async def org(self, org_id: str, param: str | None = None) -> dict[str, Any]:
        """The org object, or 404."""
        org = await self.view.org(org_id) if self._in_scope(org_id) else None
        if org is None:
            raise not_found("org", org_id, param)
        return org

    async def key(self, key_id: str) -> dict[str, Any]:
        """The key object, or 404 (also for a key of another org than the scope's)."""
        key = await self.view.key(key_id)
        if key is None or not self._in_scope(key["org"]):
            raise not_found("key", key_id)
        return key

    async def _org_row(self, org_id: str, param: str | None = None) -> dict[str, Any]:
        row = await self.view.org_row(org_id) if self._in_scope(org_id) else None
        if row is None:
            raise not_found("org", org_id, param)
        return row

    async def _runtime_key(self, key_id: str) -> None:
        """404 for a key that exists nowhere (or in another org than the scope's), then 409 for a
        config key."""
        row = await self.view.key_row(key_id)
        if row is None or not self._in_scope(row["org"]):
            raise not_found("key", key_id)
        if row.get("source") == "config":
            raise managed_by_config("key", key_id)

    def _operator_only(self) -> None:
        if self.scope is not None:
            raise forbidden("Grants and an org's own settings are the operator's.")

    def _admins_outside(self) -> int | None:
        """For an org's own admin: the active admin keys of its org that the store does not hold (the
        config's), which ``TenancyStore`` counts with its own; None for the operator (no such rule)."""
        if self.scope is None:
            return None
        return sum(1 for k in self.view.config.keys if k.org == self.scope and k.role == "admin" and not k.disabled)

    async def grants(self, org_id: str) -> list[dict[str, Any]]:
        self._operator_only()
        await self._org_row(org_id)
        return [grant_object(g) for g in await self.store.list_grants(org_id)]

    async def keys(self, org: str | None = None) -> list[dict[str, Any]]:
        """Every key, or ``org``'s (404 naming ``org`` when it exists nowhere); the scope's only."""
        org = self.scope or org
        if org is not None:
            await self._org_row(org, "org")
        return await self.view.keys(org)

    async def events(self, org: str | None = None, **page: Any) -> list[dict[str, Any]]:
        """The audit events, newest first (``page``: the store's ``limit`` and ``before``), of ``org``
        (404 naming it when it exists nowhere), or of the scope's."""
        org = self.scope or org
        if org is not None:
            await self._org_row(org, "org")
        return await self.store.list_events(org=org, **page)

    # -- changes --

    async def create_org(self, body: Any) -> dict[str, Any]:
        self._operator_only()
        fields = bodies.org_create(body)
        org_id = fields.pop("id")
        if self.view.config_org(org_id) is not None:
            raise conflict(org_id)
        try:
            await self.store.create_org(org_id, **fields, actor=self.actor)
        except GatewayError as exc:
            if exc.code == "conflict":
                raise conflict(org_id) from None
            raise
        return await self._changed_org(org_id)

    async def update_org(self, org_id: str, body: Any) -> dict[str, Any]:
        self._operator_only()
        changes = bodies.org_patch(body)
        row = await self._org_row(org_id)
        if row.get("source") == "config":
            raise managed_by_config("org", org_id)
        await self.store.update_org(org_id, changes, actor=self.actor)
        return await self._changed_org(org_id)

    async def add_grant(self, org_id: str, body: Any) -> tuple[dict[str, Any], bool]:
        """``(grant, True)`` for a new grant; ``(the first grant, False)`` for a reference already used."""
        self._operator_only()
        fields = bodies.grant_create(body)
        await self._org_row(org_id)
        grant, created = await self.store.add_grant(org_id, fields["amount"], fields["reference"],
                                                    actor=self.actor)
        await self.after_change()  # also for a reference already used: another replica's grant may be new here
        return grant_object(grant), created

    async def create_key(self, body: Any) -> tuple[str, dict[str, Any]]:
        """``(secret, key)``: the secret is in this answer only. Scoped: of the scope's org."""
        fields = bodies.key_create(body, self.scope)
        await self._org_row(fields["org"], "org")
        secret, row = await self.store.create_key(**fields, actor=self.actor)
        await self.after_change()
        return secret, await self.key(row["id"])

    async def update_key(self, key_id: str, body: Any) -> dict[str, Any]:
        changes = bodies.key_patch(body, own=self.scope is not None)
        await self._runtime_key(key_id)
        await self.store.update_key(key_id, changes, actor=self.actor, admins_outside=self._admins_outside())
        await self.after_change()
        return await self.key(key_id)

    async def revoke_key(self, key_id: str) -> dict[str, Any]:
        """Revoke for good (its rows stay); revoking a revoked key again changes nothing."""
        await self._runtime_key(key_id)
        await self.store.revoke_key(key_id, actor=self.actor, admins_outside=self._admins_outside())
        await self.after_change()
        return await self.key(key_id)

    async def _changed_org(self, org_id: str) -> dict[str, Any]:
        await self.after_change()
        return await self.org(org_id)
