"""Orgs, keys and credit grants made at runtime, in the SQLite file or PostgreSQL.

``TenancyStore`` is written once for both stores: its queries use ``?``
placeholders and SQL both dialects read alike, run by a ``SQLiteDb`` or a
``PostgresDb`` (``kilnproxy.store.tenancy.sql``). Rows come back as plain
dicts; times are ISO-8601 UTC text, as in ``usage_events``.

Every change is one transaction that first bumps the change counter
(``kiln_version``: its row lock puts the changes of every replica and command
in one order), then makes the change and writes its audit event, whose id
is the counter's new value. So ``version()`` says whether anything changed
since it was last read, and ``list_events`` is the log of every change. A
request that changes nothing (a patch to the same values, revoking a key
already revoked, a grant reference already used) rolls back: no event, no
new version.

Secrets: ``create_key`` makes the secret (``sk-`` + 32 random bytes) and
returns it once; the store keeps its SHA-256 and its first 8 characters
(``prefix``). No row, event or answer holds it afterwards.

Roles: a key is a ``member`` or an ``admin`` (which may also call the org API).
A change made by an org's own admin passes ``admins_outside`` and is refused
(409 ``conflict``) when it would leave the org no active admin key; the
operator's changes do not pass it.

What the gateway needs to authenticate without a round trip, ``snapshot()``
reads in one consistent moment: the orgs, the keys by SHA-256, the grants'
sum per org and the version they are at.

The store does not know the config's orgs and keys: the caller checks that an
org exists (config or runtime) before granting or making a key, and answers
404 / 409 itself (the admin API's order: 400, 404, 409).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable, Iterable, Mapping

import orjson

from ...config_types import sha256_hex
from ...errors import GatewayError
from ...usage import round_usd
from .key_usage import usage_by_key
from .validation import iso_utc

ORG_COLUMNS = "id, max_in_flight, disabled, requests_per_minute, tokens_per_minute, priority, weight, created_at"
KEY_COLUMNS = ('id, prefix, name, org, models, "limit", limit_reset, expires_at, disabled, revoked_at, '
               'requests_per_minute, tokens_per_minute, priority, weight, created_at, role')
GRANT_COLUMNS = "id, org, amount, reference, created_at"
EVENT_COLUMNS = "id, at, kind, org, subject, actor, detail"

ORG_SETTABLE = ("max_in_flight", "disabled", "requests_per_minute", "tokens_per_minute", "priority", "weight")
KEY_SETTABLE = ("name", "models", "limit", "limit_reset", "expires_at", "disabled",
                "requests_per_minute", "tokens_per_minute", "priority", "weight", "role")

BUMP = "UPDATE kiln_version SET version = version + 1 WHERE id = 1 RETURNING version"
INSERT_EVENT = f"INSERT INTO kiln_audit ({EVENT_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?)"
OTHER_ADMINS = ("SELECT COUNT(*) FROM kiln_keys WHERE org = ? AND id <> ? AND role = 'admin' AND disabled = 0 "
                "AND revoked_at IS NULL AND (expires_at IS NULL OR expires_at > ?)")  # the (org, role) index


def conflict(message: str) -> GatewayError:
    return GatewayError(409, "conflict", message)


def new_secret() -> str:
    return "sk-" + secrets.token_urlsafe(32)


def active_admin(key: Mapping[str, Any], now: str) -> bool:
    """Whether ``key`` (a key's row, or a row with a change applied) may call the org API at ``now``
    (ISO-8601 UTC text): an admin, not disabled, not revoked, not expired."""
    return (key["role"] == "admin" and not key["disabled"] and key.get("revoked_at") is None
            and (key["expires_at"] is None or key["expires_at"] > now))


def last_admin(key_id: str) -> GatewayError:
    return GatewayError(409, "conflict", f"The key `{key_id}` is its org's last active admin key: make another "
                        "admin key first (the operator may change it).")


@dataclass(frozen=True)
class TenancySnapshot:
    """What authentication and admission need in memory: orgs by id, keys by the SHA-256 of their
    secret, the grants' sum per org, and the ``version`` this was read at."""

    version: int
    orgs: dict[str, dict[str, Any]] = field(default_factory=dict)
    keys: dict[str, dict[str, Any]] = field(default_factory=dict)
    granted: dict[str, float] = field(default_factory=dict)


class _Unchanged(Exception):
    """Raised inside a change's transaction to roll it back and answer ``row`` as it is."""

    def __init__(self, row: Any):
        self.row = row


def _now() -> datetime:
    return datetime.now(timezone.utc)


class TenancyStore:
    """Runtime orgs, keys, grants and their audit log on ``db`` (a ``SQLiteDb`` or ``PostgresDb``)."""

    def __init__(self, db: Any, clock: Callable[[], datetime] = _now):
        self.db = db
        self.clock = clock

    # -- changes ----------------------------------------------------------------------------------

    async def _event(self, tx: Any, version: int, kind: str, org: str, subject: str,
                     detail: Mapping[str, Any], actor: str | None) -> None:
        await tx.fetch(INSERT_EVENT, version, self._stamp(), kind, org, subject, actor,
                       orjson.dumps(detail).decode())
        await tx.changed(version)

    def _stamp(self) -> str:
        return iso_utc(self.clock())

    async def create_org(self, id: str, max_in_flight: int | None = None, requests_per_minute: int | None = None,
                         tokens_per_minute: int | None = None, priority: str | None = None,
                         weight: float | None = None, *, actor: str | None = None) -> dict[str, Any]:
        """A new org (``priority`` None: interactive; ``weight`` None: 1); 409 ``conflict`` if a runtime org
        has that id (the caller checks the config's)."""
        priority = priority or "interactive"
        weight = 1.0 if weight is None else float(weight)
        values = {"max_in_flight": max_in_flight, "requests_per_minute": requests_per_minute,
                  "tokens_per_minute": tokens_per_minute, "priority": priority, "weight": weight}
        try:
            async with self.db.transaction() as tx:
                version = await tx.fetchval(BUMP)
                row = await tx.fetchrow(
                    f"INSERT INTO kiln_runtime_orgs ({ORG_COLUMNS}) VALUES (?, ?, 0, ?, ?, ?, ?, ?) "
                    f"ON CONFLICT (id) DO NOTHING RETURNING {ORG_COLUMNS}",
                    id, max_in_flight, requests_per_minute, tokens_per_minute, priority, weight, self._stamp())
                if row is None:
                    raise _Unchanged(None)
                await self._event(tx, version, "org.created", id, id, values, actor)
        except _Unchanged:
            raise conflict(f"An org with id `{id}` already exists.") from None
        return _org(row)

    async def update_org(self, org_id: str, changes: Mapping[str, Any], *,
                         actor: str | None = None) -> dict[str, Any] | None:
        """Set the fields of ``changes`` (those of ``tenancy_validation.org_patch``); None if no such
        runtime org. An event ``org.updated`` with the fields' old and new values, if any changed."""
        return await self._update("kiln_runtime_orgs", ORG_COLUMNS, ORG_SETTABLE, _org, "org.updated",
                                  org_id, changes, actor)

    async def _update(self, table: str, columns: str, settable: tuple[str, ...], shape: Callable,
                      kind: str, row_id: str, changes: Mapping[str, Any], actor: str | None,
                      admins_outside: int | None = None) -> Any:
        unknown = set(changes) - set(settable)
        if unknown:
            raise ValueError(f"not fields of {table}: {sorted(unknown)}")
        try:
            async with self.db.transaction() as tx:
                version = await tx.fetchval(BUMP)
                old = await tx.fetchrow(f"SELECT {columns} FROM {table} WHERE id = ?", row_id)
                if old is None:
                    raise _Unchanged(None)
                before = shape(old)
                diff = {name: value for name, value in changes.items() if before[name] != value}
                if not diff:
                    raise _Unchanged(before)
                if admins_outside is not None:
                    await self._keep_an_admin(tx, old, {**old, **diff}, admins_outside)
                sets = ", ".join(f'"{name}" = ?' for name in diff)
                row = await tx.fetchrow(f"UPDATE {table} SET {sets} WHERE id = ? RETURNING {columns}",
                                        *(_stored(name, value) for name, value in diff.items()), row_id)
                detail = {"from": {n: before[n] for n in diff}, "to": diff}
                await self._event(tx, version, kind, before.get("org", row_id), row_id, detail, actor)
        except _Unchanged as unchanged:
            return unchanged.row
        return shape(row)

    async def add_grant(self, org: str, amount: float, reference: str, *,
                        actor: str | None = None) -> tuple[dict[str, Any], bool]:
        """Credit ``org`` with ``amount`` USD (negative: a correction), once per ``reference``:
        ``(grant, True)`` for a new grant, ``(the first grant, False)`` when the reference was used.
        The unique (org, reference) decides, also between replicas posting at the same moment."""
        grant_id = "grant_" + secrets.token_hex(8)
        try:
            async with self.db.transaction() as tx:
                version = await tx.fetchval(BUMP)
                row = await tx.fetchrow(
                    f"INSERT INTO kiln_grants ({GRANT_COLUMNS}) VALUES (?, ?, ?, ?, ?) "
                    f"ON CONFLICT (org, reference) DO NOTHING RETURNING {GRANT_COLUMNS}",
                    grant_id, org, float(amount), reference, self._stamp())
                if row is None:
                    raise _Unchanged(None)
                await self._event(tx, version, "grant.created", org, grant_id,
                                  {"amount": row["amount"], "reference": reference}, actor)
        except _Unchanged:
            first = await self.db.fetchrow(
                f"SELECT {GRANT_COLUMNS} FROM kiln_grants WHERE org = ? AND reference = ?", org, reference)
            return first, False
        return row, True

    async def create_key(self, org: str, name: str, models: list[str] | None = None, limit: float | None = None,
                         limit_reset: str | None = None, expires_at: str | None = None,
                         requests_per_minute: int | None = None, tokens_per_minute: int | None = None,
                         priority: str | None = None, weight: float | None = None, role: str | None = None, *,
                         actor: str | None = None) -> tuple[str, dict[str, Any]]:
        """A new key of ``org`` (``role`` None: a member): ``(secret, key)``. The secret is in this
        answer only."""
        secret = new_secret()
        key_id = "key_" + secrets.token_hex(8)
        role = role or "member"
        fields = {"name": name, "models": models, "limit": limit, "limit_reset": limit_reset,
                  "expires_at": expires_at, "requests_per_minute": requests_per_minute,
                  "tokens_per_minute": tokens_per_minute, "priority": priority, "weight": weight, "role": role}
        async with self.db.transaction() as tx:
            version = await tx.fetchval(BUMP)
            row = await tx.fetchrow(
                f"INSERT INTO kiln_keys (sha256, {KEY_COLUMNS}) "
                f"VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, 0, NULL, ?, ?, ?, ?, ?, ?) RETURNING {KEY_COLUMNS}",
                sha256_hex(secret), key_id, secret[:8], name, org, _stored("models", models),
                None if limit is None else float(limit), limit_reset, expires_at, requests_per_minute,
                tokens_per_minute, priority, None if weight is None else float(weight), self._stamp(), role)
            await self._event(tx, version, "key.created", org, key_id, {"prefix": secret[:8], **fields}, actor)
        return secret, _key(row)

    async def update_key(self, key_id: str, changes: Mapping[str, Any], *, actor: str | None = None,
                         admins_outside: int | None = None) -> dict[str, Any] | None:
        """Set the fields of ``changes`` (those of ``tenancy_validation.key_patch``); None if no such
        runtime key. A revoked key can still be changed (it stays revoked). With ``admins_outside``
        (a change by an org's own admin): 409 ``conflict``, nothing changed, when the change would
        leave the key's org no active admin key (``_keep_an_admin``)."""
        return await self._update("kiln_keys", KEY_COLUMNS, KEY_SETTABLE, _key, "key.updated",
                                  key_id, changes, actor, admins_outside)

    async def revoke_key(self, key_id: str, *, actor: str | None = None,
                         admins_outside: int | None = None) -> dict[str, Any] | None:
        """Revoke for good (its usage rows stay); None if no such key. Revoking it again changes nothing.
        ``admins_outside``: as ``update_key``'s."""
        try:
            async with self.db.transaction() as tx:
                version = await tx.fetchval(BUMP)
                row = await tx.fetchrow(f"SELECT {KEY_COLUMNS} FROM kiln_keys WHERE id = ?", key_id)
                if row is None or row["revoked_at"] is not None:
                    raise _Unchanged(row)
                if admins_outside is not None:
                    await self._keep_an_admin(tx, row, {**row, "revoked_at": self._stamp()}, admins_outside)
                row = await tx.fetchrow(f"UPDATE kiln_keys SET revoked_at = ? WHERE id = ? RETURNING {KEY_COLUMNS}",
                                        self._stamp(), key_id)
                await self._event(tx, version, "key.revoked", row["org"], key_id, {"prefix": row["prefix"]}, actor)
        except _Unchanged as unchanged:
            return None if unchanged.row is None else _key(unchanged.row)
        return _key(row)

    async def _keep_an_admin(self, tx: Any, before: Mapping[str, Any], after: Mapping[str, Any],
                             admins_outside: int) -> None:
        """409 ``conflict`` when the key ``before`` is an active admin, ``after`` (the same row
        changed) is not, and its org has no other: none in the store and ``admins_outside`` (those
        of the config) zero. Read after ``BUMP``, whose row lock orders every change of every
        replica: two admins demoting each other at once cannot both pass."""
        now = self._stamp()
        if admins_outside > 0 or not active_admin(before, now) or active_admin(after, now):
            return
        if await tx.fetchval(OTHER_ADMINS, before["org"], before["id"], now) == 0:
            raise last_admin(before["id"])

    # -- reads ------------------------------------------------------------------------------------

    async def get_org(self, org_id: str) -> dict[str, Any] | None:
        row = await self.db.fetchrow(f"SELECT {ORG_COLUMNS} FROM kiln_runtime_orgs WHERE id = ?", org_id)
        return None if row is None else _org(row)

    async def list_orgs(self) -> list[dict[str, Any]]:
        return [_org(r) for r in await self.db.fetch(f"SELECT {ORG_COLUMNS} FROM kiln_runtime_orgs ORDER BY id")]

    async def list_grants(self, org: str) -> list[dict[str, Any]]:
        """The grants of ``org``, oldest first."""
        return await self.db.fetch(
            f"SELECT {GRANT_COLUMNS} FROM kiln_grants WHERE org = ? ORDER BY created_at, id", org)

    async def granted_by_org(self) -> dict[str, float]:
        """The sum of the grants of each org that has any (the config's ``credits`` not included)."""
        rows = await self.db.fetch("SELECT org, SUM(amount) AS total FROM kiln_grants GROUP BY org")
        return {r["org"]: round_usd(r["total"]) for r in rows}

    async def get_key(self, key_id: str) -> dict[str, Any] | None:
        row = await self.db.fetchrow(f"SELECT {KEY_COLUMNS} FROM kiln_keys WHERE id = ?", key_id)
        return None if row is None else _key(row)

    async def list_keys(self, org: str | None = None) -> list[dict[str, Any]]:
        """Every runtime key (revoked ones included), or those of ``org``; oldest first."""
        if org is None:
            rows = await self.db.fetch(f"SELECT {KEY_COLUMNS} FROM kiln_keys ORDER BY created_at, id")
        else:
            rows = await self.db.fetch(f"SELECT {KEY_COLUMNS} FROM kiln_keys WHERE org = ? ORDER BY created_at, id",
                                       org)
        return [_key(r) for r in rows]

    async def list_events(self, limit: int = 100, before: int | None = None,
                          org: str | None = None) -> list[dict[str, Any]]:
        """Audit events, newest first: at most ``limit``, with ids below ``before`` (paging), of ``org``."""
        where, args = [], []
        if before is not None:
            where.append("id < ?")
            args.append(before)
        if org is not None:
            where.append("org = ?")
            args.append(org)
        clause = f"WHERE {' AND '.join(where)} " if where else ""
        rows = await self.db.fetch(f"SELECT {EVENT_COLUMNS} FROM kiln_audit {clause}ORDER BY id DESC LIMIT ?",
                                   *args, limit)
        return [{**r, "detail": orjson.loads(r["detail"])} for r in rows]

    async def version(self) -> int:
        """The change counter: it moves with every change committed, by any replica or command."""
        return await self.db.fetchval("SELECT version FROM kiln_version WHERE id = 1")

    async def snapshot(self) -> TenancySnapshot:
        """Orgs, keys (by SHA-256, revoked ones included) and grants per org, read in one moment."""
        async with self.db.transaction(snapshot=True) as tx:
            version = await tx.fetchval("SELECT version FROM kiln_version WHERE id = 1")
            orgs = await tx.fetch(f"SELECT {ORG_COLUMNS} FROM kiln_runtime_orgs")
            keys = await tx.fetch(f"SELECT sha256, {KEY_COLUMNS} FROM kiln_keys")
            granted = await tx.fetch("SELECT org, SUM(amount) AS total FROM kiln_grants GROUP BY org")
        by_sha256 = {}
        for key in keys:
            digest = key.pop("sha256")
            by_sha256[digest] = _key(key)
        return TenancySnapshot(version=version, orgs={o["id"]: _org(o) for o in orgs}, keys=by_sha256,
                               granted={g["org"]: round_usd(g["total"]) for g in granted})

    async def usage_by_key(self, keys: Iterable[Mapping[str, Any]], now: datetime | None = None) -> dict[str, float]:
        """Each key's USD usage in its current period (``key_usage.usage_by_key``), by key id."""
        return await usage_by_key(self.db, keys, now or self.clock())


def _org(row: Mapping[str, Any]) -> dict[str, Any]:
    return {**row, "disabled": bool(row["disabled"]), "weight": float(row["weight"])}


def _key(row: Mapping[str, Any]) -> dict[str, Any]:
    models, weight = row["models"], row["weight"]
    return {**row, "models": None if models is None else orjson.loads(models),
            "disabled": bool(row["disabled"]), "revoked": row["revoked_at"] is not None,
            "weight": None if weight is None else float(weight)}


def _stored(name: str, value: Any) -> Any:
    """A field's value as the column holds it: booleans as 0/1, the models list as JSON text."""
    if name == "disabled":
        return int(value)
    if name == "models":
        return None if value is None else orjson.dumps(value).decode()
    if name in ("limit", "weight") and value is not None:
        return float(value)
    return value
