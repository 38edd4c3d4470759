"""The org and key objects of the admin API, the org API, ``GET /v1/key`` and the ``orgs`` / ``keys`` commands.

One shape for both sources: orgs and keys of the config (``"source": "config"``)
and those made at runtime (``"source": "api"``)::

    org: {"id", "granted", "spent", "held", "remaining", "max_in_flight", "disabled", "source",
          "requests_per_minute", "tokens_per_minute", "priority", "weight"}
    key: {"id", "name", "org", "role", "prefix", "models", "disabled", "revoked", "limit", "limit_reset",
          "usage", "limit_remaining", "expires_at", "created_at", "source",
          "requests_per_minute", "tokens_per_minute", "priority", "weight"}

USD amounts are rounded as the usage rows' costs are (``usage.round_usd``).
``granted`` is the config's ``credits`` plus the org's grants; ``remaining`` =
``granted`` − ``spent``, as ``/v1/credits``; ``held`` (the holds of requests in
flight) is shown apart, not subtracted. ``max_in_flight`` is the org's own
setting, null when it takes ``[limits] max_in_flight_per_org``. A key's
``usage`` is the USD it spent in its current period (since it was made when
``limit_reset`` is null; since ever for a config key); ``limit_remaining`` =
``limit`` − ``usage``, null without a limit. ``prefix`` is the secret's first
8 characters, null for a config key the config gives by its hash only. A
config key has no USD limit, no expiry and no ``created_at``; its ``name`` is its
id. An org's ``priority`` and ``weight`` (SPEC 14) are always given; a key's are
null when it takes its org's. ``role`` is ``admin`` (the key may also call the org
API) or ``member``. The secret is in none of them.

``org_object`` and ``key_object`` are pure functions of rows and numbers;
``TenancyView`` gathers the rows and numbers for them, from the config and the
store, whether or not a gateway runs (``Books`` says where spending and holds
come from: a running gateway's memory, or the store).
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable, Iterable, Mapping

from ...config import Config, KeyConfig, OrgConfig
from ...store.tenancy.orgs_keys import TenancyStore
from ...store.books import held_by_org, spent_by_org
from ...store.tenancy.validation import storable
from ...usage import round_usd

ORG_FIELDS = ("id", "granted", "spent", "held", "remaining", "max_in_flight", "disabled", "source",
              "requests_per_minute", "tokens_per_minute", "priority", "weight")
KEY_FIELDS = ("id", "name", "org", "role", "prefix", "models", "disabled", "revoked", "limit", "limit_reset", "usage",
              "limit_remaining", "expires_at", "created_at", "source", "requests_per_minute", "tokens_per_minute",
              "priority", "weight")
SINCE_EVER = ""  # a period start below every ISO-8601 time: a config key's usage counts every row


# -- pure: rows and numbers -> objects -------------------------------------------------------------

def config_org_row(org: OrgConfig) -> dict[str, Any]:
    """A config org in the shape of a runtime org's row."""
    return {"id": org.id, "max_in_flight": org.max_in_flight, "disabled": False,
            "requests_per_minute": org.requests_per_minute, "tokens_per_minute": org.tokens_per_minute,
            "priority": org.priority, "weight": org.weight, "source": "config"}


def config_key_row(key: KeyConfig) -> dict[str, Any]:
    """A config key in the shape of a runtime key's row."""
    return {"id": key.id, "name": key.name or key.id, "org": key.org, "role": key.role, "prefix": key.prefix,
            "models": None if key.models is None else list(key.models), "disabled": key.disabled,
            "revoked": False, "limit": None, "limit_reset": None, "expires_at": None, "created_at": None,
            "requests_per_minute": key.requests_per_minute, "tokens_per_minute": key.tokens_per_minute,
            "priority": key.priority, "weight": key.weight, "source": "config"}


def org_object(row: Mapping[str, Any], granted: float, spent: float, held: float) -> dict[str, Any]:
    """The org object of ``row`` (a runtime org's, or ``config_org_row``'s) and its money in USD."""
    numbers = {"granted": round_usd(granted), "spent": round_usd(spent), "held": round_usd(held),
               "remaining": round_usd(granted - spent)}
    out = {**row, **numbers, "source": row.get("source", "api")}
    return {name: out.get(name) for name in ORG_FIELDS}


def key_object(row: Mapping[str, Any], usage: float) -> dict[str, Any]:
    """The key object of ``row`` (a runtime key's, or ``config_key_row``'s) and its usage in USD."""
    limit = row["limit"]
    out = {**row, "usage": round_usd(usage), "source": row.get("source", "api"),
           "limit_remaining": None if limit is None else round_usd(limit - usage)}
    return {name: out.get(name) for name in KEY_FIELDS}


def grant_object(row: Mapping[str, Any]) -> dict[str, Any]:
    """``{"id", "org", "amount", "reference", "created_at"}``, ``amount`` always a JSON number with a
    fraction (SQLite may hand a whole REAL back as an integer)."""
    return {"id": row["id"], "org": row["org"], "amount": float(row["amount"]), "reference": row["reference"],
            "created_at": row["created_at"]}


def usage_period(row: Mapping[str, Any]) -> dict[str, Any]:
    """What ``TenancyStore.usage_by_key`` needs of a key: a config key's period is since ever."""
    if row.get("source") == "config":
        return {"id": row["id"], "limit_reset": None, "created_at": SINCE_EVER}
    return row


# -- gatherers: rows and numbers from the config and the store ---------------------------------------

class Books:
    """Where each org's ``spent`` and ``held`` come from.

    ``credits`` and ``admission``: a running gateway on SQLite, whose memory has
    both exactly (``Credits.spent``, ``LocalAdmission.held``). Without them (a
    command), the store's totals; on PostgreSQL spending and holds always come
    from the store, which every replica writes. A command on SQLite cannot see a
    gateway's holds and shows 0."""

    def __init__(self, db: Any, replica_timeout: float, credits: Any = None, admission: Any = None,
                 committed: Callable[[], Awaitable[None]] | None = None):
        self.db = db
        self.replica_timeout = replica_timeout
        self.credits = credits
        self.admission = admission
        # a running gateway's ``rows_committed``: the rows of the responses it has ended are counted
        self.committed = committed

    async def spent(self, orgs: Iterable[str]) -> dict[str, float]:
        if self.committed is not None:
            await self.committed()
        if self.db.dialect == "sqlite" and self.credits is not None:
            known = self.credits.spent
        else:
            known = await spent_by_org(self.db)
        return {org: known.get(org, 0.0) for org in orgs}

    async def held(self, orgs: Iterable[str]) -> dict[str, float]:
        if self.committed is not None:
            await self.committed()
        known = await held_by_org(self.db, self.replica_timeout)
        if known is None:
            if self.admission is None:  # a command on SQLite: a gateway's holds are in its memory
                return {org: 0.0 for org in orgs}
            return {org: self.admission.held(org) for org in orgs}
        return {org: known.get(org, 0.0) for org in orgs}


class TenancyView:
    """The orgs and keys of ``config`` and ``store``, as objects; None for an id that exists nowhere.

    Reads the store at each call (not a gateway's in-memory copy), so an answer
    shows every change committed before it, by any replica or command."""

    def __init__(self, config: Config, store: TenancyStore, books: Books):
        self.config = config
        self.store = store
        self.books = books

    # -- rows --

    def config_org(self, org_id: str) -> OrgConfig | None:
        return next((o for o in self.config.orgs if o.id == org_id), None)

    def config_key(self, key_id: str) -> KeyConfig | None:
        return next((k for k in self.config.keys if k.id == key_id), None)

    async def org_row(self, org_id: str) -> dict[str, Any] | None:
        config = self.config_org(org_id)
        if config is not None:
            return config_org_row(config)
        return await self.store.get_org(org_id) if storable(org_id) else None

    async def key_row(self, key_id: str) -> dict[str, Any] | None:
        config = self.config_key(key_id)
        if config is not None:
            return config_key_row(config)
        return await self.store.get_key(key_id) if storable(key_id) else None

    # -- objects --

    async def orgs_of(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        ids = [r["id"] for r in rows]
        grants = await self.store.granted_by_org()
        credits = {o.id: o.credits for o in self.config.orgs}
        spent, held = await self.books.spent(ids), await self.books.held(ids)
        return [org_object(r, credits.get(r["id"], 0.0) + grants.get(r["id"], 0.0), spent[r["id"]],
                           held[r["id"]]) for r in rows]

    async def keys_of(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        usage = await self.store.usage_by_key([usage_period(r) for r in rows])
        return [key_object(r, usage.get(r["id"], 0.0)) for r in rows]

    async def org(self, org_id: str) -> dict[str, Any] | None:
        row = await self.org_row(org_id)
        return None if row is None else (await self.orgs_of([row]))[0]

    async def orgs(self) -> list[dict[str, Any]]:
        """Every org, of both sources, by id."""
        rows = [config_org_row(o) for o in self.config.orgs] + await self.store.list_orgs()
        return await self.orgs_of(sorted(rows, key=lambda r: r["id"]))

    async def key(self, key_id: str) -> dict[str, Any] | None:
        row = await self.key_row(key_id)
        return None if row is None else (await self.keys_of([row]))[0]

    async def keys(self, org: str | None = None) -> list[dict[str, Any]]:
        """Every key (revoked ones included), or those of ``org``: the config's first, in its order,
        then the runtime keys, oldest first."""
        rows = [config_key_row(k) for k in self.config.keys if org is None or k.org == org]
        return await self.keys_of(rows + await self.store.list_keys(org))


def gateway_view(gw: Any) -> TenancyView:
    """The view of a running ``Gateway``: its config, its store, its spending and holds."""
    books = Books(gw.tenancy.db, gw.config.storage.replica_timeout_seconds, gw.credits, gw.admission,
                  gw.rows_committed)
    return TenancyView(gw.config, gw.tenancy, books)
