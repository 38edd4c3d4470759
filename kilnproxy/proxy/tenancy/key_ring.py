"""``Tenants``: the orgs and keys one gateway serves, the config's and the store's, held in memory.

Authentication stays a dict lookup per request: whenever the store's change
counter moves (``refresh``, called by the ``ChangeWatch`` within a second, and
by the admin API before it answers), the store's snapshot is merged with the
config and swapped in at once (``apply``): ``gw.keys`` (config keys and
runtime keys not revoked), ``gw.credits.granted`` (the config's ``credits``
plus the grants), ``gw.org_limits``, ``gw.per_minute`` (the orgs' requests and tokens per
minute), ``gw.shares`` (the orgs' ``priority`` and ``weight``, SPEC 14) and
``gw.disabled_orgs``. Nothing is
awaited during the swap, so no request sees half of a change; requests already
admitted go on.

An org id may come from the config or the store, never both: a config naming
an org made at runtime is refused at start-up and at reload, and so is a config
that drops an org the store's keys or grants still name, or that has a key
with a runtime key's secret (``check_config``).
"""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime
from typing import Any, Iterable

from ...config import Config, KeyConfig, OrgConfig
from ...errors import ConfigError
from ...store.tenancy.key_usage import period_start
from ...store.tenancy.orgs_keys import TenancySnapshot, TenancyStore
from ...store.tenancy.watch import ChangeWatch
from .auth import KeyRing

log = logging.getLogger("kilnproxy.tenancy")

DEFAULT_SHARE = ("interactive", 1.0)  # an org's (priority, weight) unless it has its own


def org_shares(orgs: Iterable[OrgConfig]) -> dict[str, tuple[str, float]]:
    """The config's orgs' (priority, weight), those other than ``DEFAULT_SHARE`` only."""
    return {o.id: share for o in orgs if (share := (o.priority, o.weight)) != DEFAULT_SHARE}


class Tenants:
    def __init__(self, gw: Any, store: TenancyStore, postgres_url: str | None = None):
        self.gw = gw
        self.store = store
        self.snapshot = TenancySnapshot(version=-1)
        self.runtime_keys: dict[str, KeyConfig] = {}  # by key id, revoked ones left out
        self.unreadable: set[str] = set()  # ids of keys whose stored expires_at cannot be read (warned once)
        self.watch = ChangeWatch(self.refresh, postgres_url)
        self._refreshing = asyncio.Lock()

    async def open(self) -> None:
        """Read the store, refuse a config naming a runtime org, apply, and start watching."""
        self.snapshot = await self.store.snapshot()
        self.check_config(self.gw.config)
        await self._load_key_spending()
        self.apply(self.gw.config)
        self.watch.start()

    async def close(self) -> None:
        await self.watch.stop()

    async def refresh(self) -> bool:
        """Reload from the store if anything changed there; True if it did. One at a time (the
        watcher's and the admin API's), so an older snapshot never replaces a newer one."""
        async with self._refreshing:
            if await self.store.version() == self.snapshot.version:
                return False
            snapshot = await self.store.snapshot()
            if snapshot.version <= self.snapshot.version:
                return False
            self.snapshot = snapshot
            await self._load_key_spending()
            self.apply(self.gw.config)
            return True

    def check_config(self, config: Config) -> None:
        """``ConfigError`` (one line) for a config that does not fit the store: it lists an org made at
        runtime; it drops an org that still has runtime keys (not revoked) or grants; or one of its keys
        has the secret of a runtime key (revoked or not)."""
        clash = sorted(o.id for o in config.orgs if o.id in self.snapshot.orgs)
        if clash:
            raise ConfigError(f"{config.source}: [[orgs]] {', '.join(clash)} already exist(s) in the store, made at "
                              "runtime (kilnproxy orgs / the admin API): remove it from the config")
        self._check_orphans(config)
        self._check_secrets(config)

    def _check_orphans(self, config: Config) -> None:
        known = {o.id for o in config.orgs} | set(self.snapshot.orgs)
        keys: dict[str, int] = {}
        for row in self.snapshot.keys.values():
            if not row["revoked"] and row["org"] not in known:
                keys[row["org"]] = keys.get(row["org"], 0) + 1
        grants = {org: total for org, total in self.snapshot.granted.items() if org not in known}
        orphans = sorted(keys.keys() | grants.keys())
        if orphans:
            org, held = orphans[0], []
            if org in keys:
                held.append(f"{keys[org]} runtime key(s)")
            if org in grants:
                held.append(f"grants of {grants[org]:g} USD")
            raise ConfigError(f"{config.source}: [[orgs]] has no org '{org}', which still has {' and '.join(held)} "
                              "in the store (kilnproxy keys / the admin API): keep its [[orgs]] entry")

    def _check_secrets(self, config: Config) -> None:
        for key in config.keys:
            row = self.snapshot.keys.get(key.key_sha256)
            if row is not None:
                raise ConfigError(f"{config.source}: [[keys]] '{key.id}' has the same secret as the runtime key "
                                  f"'{row['id']}' (kilnproxy keys / the admin API): give '{key.id}' another secret")

    def apply(self, config: Config) -> None:
        """Swap in the merge of ``config`` and the last snapshot (no await: all at once)."""
        snap, default = self.snapshot, config.limits.max_in_flight_per_org
        runtime = {k.id: k for k in (self._runtime_key(d, row) for d, row in snap.keys.items()) if k is not None}
        granted = {o.id: o.credits for o in config.orgs}
        limits = {o.id: o.max_in_flight or default for o in config.orgs}
        per_minute = {o.id: (o.requests_per_minute, o.tokens_per_minute) for o in config.orgs}
        shares = org_shares(config.orgs)
        for org in snap.orgs.values():
            granted.setdefault(org["id"], 0.0)
            limits[org["id"]] = org["max_in_flight"] or default
            per_minute[org["id"]] = (org["requests_per_minute"], org["tokens_per_minute"])
            if (share := (org["priority"], org["weight"])) != DEFAULT_SHARE:
                shares[org["id"]] = share
        for org, amount in snap.granted.items():
            granted[org] = granted.get(org, 0.0) + amount
        gw = self.gw
        gw.keys = KeyRing(config.keys + tuple(runtime.values()))
        gw.credits.granted = granted
        gw.org_limits = limits
        gw.per_minute = {org: bounds for org, bounds in per_minute.items() if bounds != (None, None)}
        gw.shares = shares
        gw.disabled_orgs = frozenset(o["id"] for o in snap.orgs.values() if o["disabled"])
        self.runtime_keys = runtime

    def _runtime_key(self, digest: str, row: dict[str, Any]) -> KeyConfig | None:
        if row["revoked"]:
            return None
        models = row["models"]
        return KeyConfig(key_sha256=digest, org=row["org"], id=row["id"],
                         models=None if models is None else tuple(models), disabled=row["disabled"],
                         prefix=row["prefix"], name=row["name"], source="api", expires_at=self._expiry(row),
                         limit=row["limit"], limit_reset=row["limit_reset"], created_at=row["created_at"],
                         requests_per_minute=row["requests_per_minute"], tokens_per_minute=row["tokens_per_minute"],
                         priority=row["priority"], weight=row["weight"], role=row["role"])

    def _expiry(self, row: dict[str, Any]) -> float | None:
        """The key's ``expires_at`` as a POSIX time. A text that cannot be read (a store written by an
        older version) counts as long expired, so the key is refused; one warning per key."""
        try:
            return _posix(row["expires_at"])
        except (ValueError, OverflowError):
            if row["id"] not in self.unreadable:
                self.unreadable.add(row["id"])
                log.warning("key %s: its stored expires_at %r cannot be read; the key is refused as expired "
                            "until a valid expires_at is set", row["id"], row["expires_at"])
            return EXPIRED

    async def _load_key_spending(self) -> None:
        """A key newly limited (or in a new period) on one process' store: its spending so far."""
        spending = getattr(self.gw.admission, "key_spending", None)
        if spending is None:
            return
        limited = [row for row in self.snapshot.keys.values() if row["limit"] is not None and not row["revoked"]]
        todo = [row for row in limited if not spending.known(row["id"], period_start(row["limit_reset"],
                                                                                   row["created_at"]))]
        if todo:
            for key_id, spent in (await self.store.usage_by_key(todo)).items():
                row = next(r for r in todo if r["id"] == key_id)
                spending.load(key_id, period_start(row["limit_reset"], row["created_at"]), spent)

    # -- lookups for the admin API and GET /v1/key ------------------------------------------------

    def org_source(self, org_id: str) -> str | None:
        """``"config"``, ``"api"``, or None for an org that exists nowhere."""
        if any(o.id == org_id for o in self.gw.config.orgs):
            return "config"
        return "api" if org_id in self.snapshot.orgs else None

    def config_key(self, key_id: str) -> KeyConfig | None:
        return next((k for k in self.gw.config.keys if k.id == key_id), None)


EXPIRED = 0.0  # the POSIX time of a key whose expiry cannot be read


def _posix(iso: str | None) -> float | None:
    """A stored time as a POSIX time (None stays None); ``ValueError`` for a text that is not ISO-8601."""
    return None if iso is None else datetime.fromisoformat(iso).timestamp()
