"""Reloading the config without a restart (SIGHUP, ``POST /admin/reload``).

The config file the gateway started from is read and validated again. A bad
one is refused with one log line and the running config stays in force.
A good one is swapped in all at once, between two requests (nothing here
awaits): keys, orgs, credit grants, limits, maintenance, models and their
upstreams, and the ``[admin]``, ``[log]`` and ``[health]`` tables.

Requests in flight are not disturbed: each captured its key and its route
when it started, and keeps them. An upstream whose URL is unchanged keeps its
health state and in-flight count (the same ``Upstream`` object serves on), and
an upstream URL keeps its slots and the requests queued for them: a changed
``max_in_flight`` applies to them at once (a higher one serves waiting
requests now; a lower one lets the requests in flight finish).

Some things only change at a restart, and the running values are kept (one
warning line names them): ``[server]`` host, port and upstream timeouts (the
listening socket and the upstream session), ``[storage]``, ``[metrics]``,
``[plugins]``, ``[tracing]`` and ``[batches]`` (the runner's slots). Plugins are not reloaded.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from pathlib import Path

from ..config import Config, load_config
from ..errors import KilnError
from ..proxy.gateway import Gateway
from ..proxy.upstream.routes import carry_over, routes_from
from .accesslog import AccessLog

log = logging.getLogger("kilnproxy")

RESTART_ONLY_SERVER = ("host", "port", "upstream_connect_timeout", "upstream_idle_timeout",
                       "upstream_keepalive_timeout")
RESTART_ONLY = ("storage", "metrics", "plugins", "tracing", "batches")


class Reloader:
    """Reloads one gateway; ``reload()`` never raises for a bad config."""

    def __init__(self, gw: Gateway, stats, health=None, metrics_observer=None):
        self.gw = gw
        self.stats = stats                        # kilnproxy.ops.metrics.ReloadStats
        self.health = health                      # kilnproxy.ops.health.HealthChecker, woken after a reload
        self.metrics_observer = metrics_observer  # kept first in Gateway.row_observers

    async def reload_latest(self) -> tuple[bool, str]:
        """``reload``, once the store's runtime orgs are read afresh (the config may not name one)."""
        if self.gw.tenants is not None:
            try:
                await self.gw.tenants.refresh()
            except Exception as exc:  # the store out of reach: checked against what was last read
                log.warning("config reload: cannot read runtime orgs afresh: %s", exc)
        return self.reload()

    def on_signal(self) -> None:
        """SIGHUP: ``reload_latest`` in a task of its own (kept until it is done)."""
        self._signalled = asyncio.ensure_future(self.reload_latest())

    def reload(self) -> tuple[bool, str]:
        """Read the config file again and apply it: ``(True, summary)`` or ``(False, why)``."""
        source = self.gw.config.source
        try:
            if not Path(source).is_file():
                raise KilnError(f"{source}: the gateway was not started from a config file; nothing to reload")
            new = load_config(source)
            if self.gw.tenants is not None:
                self.gw.tenants.check_config(new)
        except KilnError as exc:
            self.stats.refused += 1
            log.error("config reload refused, the running config stays in force: %s", exc)
            return False, str(exc)
        summary = self.apply(new)
        self.stats.ok += 1
        self.stats.last_ok = time.time()
        log.info("config reloaded from %s: %s", source, summary)
        return True, summary

    def apply(self, new: Config) -> str:
        """Swap ``new`` in; returns a one-line summary."""
        gw, old = self.gw, self.gw.config
        kept = restart_only_changes(old, new)
        effective = keep_restart_only(old, new)
        routes = carry_over(gw.routes, routes_from(effective.models, effective.server, gw.discovered))
        observers = self.observers_for(effective)
        # The swap: plain assignments, no await in between, so no request sees half of it.
        gw.config = effective
        gw.routes = routes
        if gw.tenants is not None:  # keys, credits, org limits: the new config merged with the store's
            gw.tenants.apply(effective)
        gw.row_observers = observers
        gw.routes_replaced()
        if kept:
            log.warning("config reload: %s changed; the running values stay until a restart"
                        " (plugins are not reloaded)", ", ".join(kept))
        if self.health is not None:
            self.health.wake()
        return (f"{len(effective.models)} model(s), {len(effective.orgs)} org(s), {len(effective.keys)} key(s),"
                f" maintenance {'on' if effective.maintenance.enabled else 'off'}")

    def observers_for(self, config: Config) -> tuple:
        observers = [self.metrics_observer] if self.metrics_observer is not None else []
        if config.log.access:
            current = next((o for o in self.gw.row_observers if isinstance(o, AccessLog)), None)
            if current is not None and current.bodies == config.log.bodies:
                observers.append(current)
            else:
                observers.append(AccessLog(bodies=config.log.bodies))
        return tuple(observers)


def restart_only_changes(old: Config, new: Config) -> list[str]:
    changed = [f"[server] {name}" for name in RESTART_ONLY_SERVER
               if getattr(old.server, name) != getattr(new.server, name)]
    changed += [f"[{name}]" for name in RESTART_ONLY if getattr(old, name) != getattr(new, name)]
    return changed


def keep_restart_only(old: Config, new: Config) -> Config:
    server = dataclasses.replace(new.server, **{n: getattr(old.server, n) for n in RESTART_ONLY_SERVER})
    return dataclasses.replace(new, server=server, **{n: getattr(old, n) for n in RESTART_ONLY},
                               base_dir=old.base_dir)


