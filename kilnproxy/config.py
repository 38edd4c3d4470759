"""TOML config -> frozen dataclasses, validated once at start-up (docs/config.md).

``load_config(path)`` either returns a complete ``Config`` (every key filled
with its default) or raises ``ConfigError`` with one line naming the file, the
key and what is wrong. Nothing else in the gateway reads the TOML.
"""

from __future__ import annotations

import math
import os
import tomllib
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping

from . import config_env, config_ops
from .config_reader import NUMBER, Reader
from .config_types import (
    ENDPOINTS,
    MAX_WEIGHT,
    PRIORITIES,
    ROLES,
    ROUTING,
    BatchesConfig,
    Config,
    KeyConfig,
    LimitsConfig,
    MaintenanceConfig,
    ModelConfig,
    OrgConfig,
    PluginsConfig,
    Pricing,
    ServerConfig,
    StorageConfig,
    sha256_hex,
)
from .errors import ConfigError


def load_config(path: str | os.PathLike | None, environ: Mapping[str, str] | None = os.environ) -> Config:
    """Read and validate the TOML file at ``path``, with the ``KILNPROXY__<TABLE>__<KEY>`` variables of
    ``environ`` on top (kilnproxy.config_env); ``path`` None: those variables on top of the defaults."""
    if path is None:
        return parse_config({}, source="<environment>", base_dir=Path.cwd(), environ=environ)
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    return parse_config(raw, source=str(path), base_dir=path.resolve().parent, environ=environ)


def parse_config(raw: Mapping[str, Any], *, source: str = "<config>", base_dir: Path = Path("."),
                 environ: Mapping[str, str] | None = None) -> Config:
    """Validate an already-parsed TOML document, with the ``KILNPROXY__*`` variables of ``environ`` (if
    given) on top."""
    with config_env.loading(environ) as sources:
        config = _parse(raw, source, base_dir)
        sources.check_all_used()
    return replace(config, settings=sources.origins)


def _parse(raw: Mapping[str, Any], source: str, base_dir: Path) -> Config:
    top = Reader(source, "", dict(raw))
    server = _server(Reader(source, "server", top.get("server", dict, {})))
    storage = _storage(Reader(source, "storage", top.get("storage", dict, {})))
    limits_r = Reader(source, "limits", top.get("limits", dict, {}))
    limits = LimitsConfig(limits_r.positive("max_in_flight_per_org", 8, integer=True))
    limits_r.done()
    maint_r = Reader(source, "maintenance", top.get("maintenance", dict, {}))
    maintenance = MaintenanceConfig(
        enabled=maint_r.get("enabled", bool, False),
        retry_after=maint_r.header("retry_after", MaintenanceConfig.retry_after),
    )
    maint_r.done()
    models = tuple(_model(source, i, t) for i, t in enumerate(top.get("models", list, [])))
    orgs = tuple(_org(source, i, t) for i, t in enumerate(top.get("orgs", list, [])))
    keys = tuple(_key(source, i, t) for i, t in enumerate(top.get("keys", list, [])))
    plugins = _plugins(Reader(source, "plugins", top.get("plugins", dict, {})))
    admin, metrics, log, health = config_ops.operations(source, top)
    inspector = config_ops.inspector(Reader(source, "inspector", top.get("inspector", dict, {})))
    tracing = config_ops.tracing(Reader(source, "tracing", top.get("tracing", dict, {})))
    batches = _batches(Reader(source, "batches", top.get("batches", dict, {})))
    top.done()
    _check_references(source, models, orgs, keys)
    return Config(server, storage, limits, maintenance, models, orgs, keys, plugins,
                  admin=admin, metrics=metrics, log=log, health=health, inspector=inspector, tracing=tracing,
                  batches=batches, base_dir=base_dir, source=source)


def _storage(r: Reader) -> StorageConfig:
    d = StorageConfig()
    url, url_env = r.get("url", str, None), r.get("url_env", str, None)
    if url is not None and url_env is not None:
        r.fail(r.key("url"), "give url or url_env, not both")
    if url_env is not None:
        url = config_env.getenv(url_env)
        if not url:
            r.fail(r.key("url_env"), f"the environment variable {url_env} is not set or empty")
    if url is not None:
        key = r.key("url_env" if url_env else "url")
        scheme = r.url(key, url, port=False, quote=False).scheme
        if scheme not in ("postgresql", "postgres"):
            r.fail(key, f"must be a postgresql:// URL, got scheme {scheme or '(none)'!r}")
    storage = StorageConfig(
        path=r.get("path", str, d.path), url=url, url_env=url_env,
        replica_timeout_seconds=float(r.positive("replica_timeout_seconds", d.replica_timeout_seconds)),
        spool_path=r.get("spool_path", str, d.spool_path))
    r.done()
    return storage


def _batches(r: Reader) -> BatchesConfig:
    d = BatchesConfig()
    batches = BatchesConfig(max_in_flight=r.positive("max_in_flight", d.max_in_flight, integer=True),
                            max_file_bytes=r.positive("max_file_bytes", d.max_file_bytes, integer=True))
    r.done()
    return batches


def _server(r: Reader) -> ServerConfig:
    d = ServerConfig()
    port = r.get("port", int, d.port)
    if not 0 <= port <= 65535:
        r.fail(r.key("port"), f"must be between 0 and 65535, got {port}")
    drain = r.get("drain_seconds", NUMBER, d.drain_seconds)
    if drain < 0:
        r.fail(r.key("drain_seconds"), f"must be 0 (stop listening at once) or more, got {drain!r}")
    server = ServerConfig(
        host=r.get("host", str, d.host),
        port=port,
        max_request_bytes=r.positive("max_request_bytes", d.max_request_bytes, integer=True),
        keepalive_seconds=float(r.positive("keepalive_seconds", d.keepalive_seconds)),
        upstream_connect_timeout=float(r.positive("upstream_connect_timeout", d.upstream_connect_timeout)),
        upstream_idle_timeout=float(r.positive("upstream_idle_timeout", d.upstream_idle_timeout)),
        upstream_max_failures=r.positive("upstream_max_failures", d.upstream_max_failures, integer=True),
        upstream_down_seconds=float(r.positive("upstream_down_seconds", d.upstream_down_seconds)),
        shutdown_grace_seconds=float(r.positive("shutdown_grace_seconds", d.shutdown_grace_seconds)),
        drain_seconds=float(drain),
        request_body_timeout=float(r.positive("request_body_timeout", d.request_body_timeout)),
        upstream_keepalive_timeout=float(r.positive("upstream_keepalive_timeout", d.upstream_keepalive_timeout)),
    )
    r.done()
    return server


def _model(source: str, i: int, table: Any) -> ModelConfig:
    r = Reader(source, f"models[{i}]", table)
    model_id = r.get("id", str, required=True)
    r.where = f"models[{i}] ({model_id})"
    upstreams, slots, reserves = _upstreams(r)
    window = r.get("context_window", int, None)
    if window is not None and window <= 0:
        r.fail(r.key("context_window"), "must be greater than 0")
    pricing_r = Reader(source, r.key("pricing"), r.get("pricing", dict, {}))
    rates = {}
    for name in ("prompt", "completion", "cached_prompt"):
        value = pricing_r.usd(name, None)
        rates[name] = None if value is None else float(value)
    discount = pricing_r.get("batch_discount", NUMBER, 1.0)
    if not 0 <= discount <= 1:
        pricing_r.fail(pricing_r.key("batch_discount"),
                       f"must be from 0 to 1 (the factor of a batch line's prices), got {discount!r}")
    pricing_r.done()
    model = ModelConfig(
        id=model_id,
        upstreams=upstreams,
        upstream_model=r.get("upstream_model", str, model_id),
        upstream_api_key_env=r.get("upstream_api_key_env", str, None),
        context_window=window,
        reject_chat_params=r.strings("reject_chat_params", ()),
        pricing=Pricing(rates["prompt"] or 0.0, rates["completion"] or 0.0, rates["cached_prompt"], float(discount)),
        upstream_max_in_flight=slots,
        upstream_batch_reserve=reserves,
        fallbacks=r.strings("fallbacks", ()),
        first_byte_timeout=_seconds(r, "first_byte_timeout"),
        request_timeout=_seconds(r, "request_timeout"),
        queue_timeout=float(r.get("queue_timeout", NUMBER, 0.0)),
        routing=r.get("routing", str, ModelConfig.routing),
        cache_aware_slack=float(r.get("cache_aware_slack", NUMBER, ModelConfig.cache_aware_slack)),
        load_poll=float(r.get("load_poll", NUMBER, ModelConfig.load_poll)),
        endpoints=_endpoints(r),
        discover=r.get("discover", bool, False),
        alias=r.get("alias", str, None),
    )
    if model.alias is not None and not model.discover:
        r.fail(r.key("alias"), "only applies with discover = true (the first model the upstream lists)")
    if model.queue_timeout < 0:
        r.fail(r.key("queue_timeout"), f"must be 0 (no waiting) or more, got {model.queue_timeout!r}")
    if model.routing not in ROUTING:
        r.fail(r.key("routing"), f"unknown routing {model.routing!r}; choose from {', '.join(ROUTING)}")
    if not 0 <= model.cache_aware_slack < math.inf:
        r.fail(r.key("cache_aware_slack"), f"must be 0 or more, got {model.cache_aware_slack!r}")
    if not 0 <= model.load_poll < math.inf:
        r.fail(r.key("load_poll"), f"must be 0 (no reads) or more seconds, got {model.load_poll!r}")
    if model_id in model.fallbacks:
        r.fail(r.key("fallbacks"), f"a model cannot be its own fallback ({model_id!r})")
    r.done()
    return model


def _endpoints(r: Reader) -> tuple[str, ...]:
    endpoints = r.strings("endpoints", ModelConfig.endpoints)
    for name in endpoints:
        if name not in ENDPOINTS:
            r.fail(r.key("endpoints"), f"unknown endpoint {name!r}; choose from {', '.join(ENDPOINTS)}")
    return endpoints


def _upstreams(r: Reader) -> tuple[tuple[str, ...], tuple[int | None, ...], tuple[int | None, ...]]:
    """``upstreams``: base URLs, each a string or ``{url = "...", max_in_flight = N, batch_reserve = R}``,
    and the model's ``batch_reserve`` (SPEC 14) for those of its capped upstreams that give none."""
    entries = r.get("upstreams", list, None)
    if not entries:
        r.fail(r.key("upstreams"), "a model needs at least one upstream base URL, e.g. \"http://127.0.0.1:8000/v1\"")
    model_reserve = r.get("batch_reserve", int, None)
    urls, slots, reserves = [], [], []
    for i, entry in enumerate(entries):
        limit = reserve = None
        if isinstance(entry, dict):
            t = Reader(r.source, f"{r.key('upstreams')}[{i}]", entry)
            url = t.get("url", str, required=True)
            limit = t.get("max_in_flight", int, None)
            if limit is not None and limit <= 0:
                t.fail(t.key("max_in_flight"), f"must be greater than 0, got {limit}")
            reserve = t.get("batch_reserve", int, None)
            if reserve is not None:
                _check_reserve(t, t.key("batch_reserve"), reserve, limit)
            t.done()
        elif isinstance(entry, str):
            url = entry
        else:
            r.fail(r.key("upstreams"), "each upstream is a base URL or a table {url = \"...\", max_in_flight = N}")
        parsed = r.url(r.key("upstreams"), url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            r.fail(r.key("upstreams"), f"{url!r} is not an http(s) base URL")
        if reserve is None and model_reserve is not None and limit is not None:
            _check_reserve(r, r.key("batch_reserve"), model_reserve, limit)
            reserve = model_reserve
        urls.append(url.rstrip("/"))
        slots.append(limit)
        reserves.append(reserve)
    if model_reserve is not None and not any(s is not None for s in slots):
        r.fail(r.key("batch_reserve"), "applies to upstreams with max_in_flight; this model has none")
    return tuple(urls), tuple(slots), tuple(reserves)


def _check_reserve(r: Reader, key: str, reserve: int, limit: int | None) -> None:
    """``batch_reserve``: from 0 to ``max_in_flight`` - 1, so that batch priority keeps one slot to run on."""
    if limit is None:
        r.fail(key, "needs max_in_flight (an upstream without a cap has no queue)")
    if not 0 <= reserve < limit:
        r.fail(key, f"must be from 0 to max_in_flight - 1 ({limit - 1}), got {reserve}")


def _seconds(r: Reader, name: str) -> float | None:
    value = r.get(name, NUMBER, None)
    if value is not None and value <= 0:
        r.fail(r.key(name), f"must be greater than 0 (leave it out for none), got {value!r}")
    return None if value is None else float(value)


def _org(source: str, i: int, table: Any) -> OrgConfig:
    r = Reader(source, f"orgs[{i}]", table)
    org = OrgConfig(
        id=r.get("id", str, required=True),
        credits=float(r.usd("credits", 0.0)),
        max_in_flight=r.get("max_in_flight", int, None),
        requests_per_minute=_per_minute(r, "requests_per_minute"),
        tokens_per_minute=_per_minute(r, "tokens_per_minute"),
        priority=_priority(r, "interactive"),
        weight=_weight(r, 1.0),
    )
    if org.max_in_flight is not None and org.max_in_flight <= 0:
        r.fail(r.key("max_in_flight"), "must be greater than 0")
    r.done()
    return org


def _priority(r: Reader, default: str | None) -> str | None:
    value = r.get("priority", str, default)
    if value is not None and value not in PRIORITIES:
        r.fail(r.key("priority"), f"must be one of {', '.join(PRIORITIES)}, got {value!r}")
    return value


def _weight(r: Reader, default: float | None) -> float | None:
    value = r.get("weight", NUMBER, default)
    if value is not None and not 0 < value <= MAX_WEIGHT:
        r.fail(r.key("weight"), f"must be a number above 0 and at most {MAX_WEIGHT:g}, got {value!r}")
    return None if value is None else float(value)


def _per_minute(r: "Reader", name: str) -> int | None:
    value = r.get(name, int, None)
    if value is not None and value <= 0:
        r.fail(r.key(name), "must be greater than 0 (leave it out for no bound)")
    return value


def _key(source: str, i: int, table: Any) -> KeyConfig:
    r = Reader(source, f"keys[{i}]", table)
    secret = r.get("key", str, None)
    digest = r.get("key_sha256", str, None)
    if (secret is None) == (digest is None):
        r.fail(r.key("key"), "give exactly one of key or key_sha256")
    if digest is not None:
        digest = digest.lower()
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            r.fail(r.key("key_sha256"), "must be 64 hex digits (sha256 of the key)")
    digest = digest or sha256_hex(secret)
    key = KeyConfig(
        key_sha256=digest,
        org=r.get("org", str, required=True),
        id=r.get("id", str, f"key-{digest[:12]}"),
        models=r.strings("models", None),
        disabled=r.get("disabled", bool, False),
        prefix=secret[:8] if secret is not None else None,
        requests_per_minute=_per_minute(r, "requests_per_minute"),
        tokens_per_minute=_per_minute(r, "tokens_per_minute"),
        priority=_priority(r, None),
        weight=_weight(r, None),
        role=r.get("role", str, "member"),
    )
    if key.role not in ROLES:
        r.fail(r.key("role"), f"must be \"admin\" or \"member\", got {key.role!r}")
    r.done()
    return key


def _plugins(r: Reader) -> PluginsConfig:
    settings = r.get("settings", dict, {})
    for name, table in settings.items():
        if not isinstance(table, dict):
            r.fail(r.key(f"settings.{name}"), "must be a table")
    plugins = PluginsConfig(
        modules=r.strings("modules", ()),
        entry_points=r.get("entry_points", bool, True),
        settings=settings,
    )
    r.done()
    return plugins


def _check_references(source: str, models, orgs, keys) -> None:
    def fail(key: str, problem: str) -> None:
        raise ConfigError(f"{source}: {key}: {problem}")

    model_ids = [m.id for m in models if not m.discover] + [m.alias for m in models if m.alias]
    for name, ids in (("models", model_ids), ("orgs", [o.id for o in orgs])):
        dupes = {x for x in ids if ids.count(x) > 1}
        if dupes:
            fail(f"{name}.id", f"{sorted(dupes)[0]!r} is defined twice")
    slots: dict[str, tuple[int, str]] = {}  # upstream URL -> (max_in_flight, the model that gave it)
    reserves: dict[str, tuple[int, str]] = {}  # upstream URL -> (batch_reserve, the model that gave it)
    for m in models:
        for f in m.fallbacks:
            if f not in model_ids:
                fail(f"models ({m.id}).fallbacks", f"model {f!r} is not in [[models]]")
        for i, (url, limit) in enumerate(zip(m.upstreams, m.upstream_max_in_flight)):
            if limit is None:
                continue
            known = slots.setdefault(url, (limit, m.id))
            if known[0] != limit:
                fail(f"models ({m.id}).upstreams", f"{url} has max_in_flight = {limit} here but {known[0]} in "
                     f"model {known[1]!r}: an upstream's slots are shared by every model that lists it, so give "
                     "it one value")
            if (reserve := m.batch_reserve_given(i)) is not None:
                given = reserves.setdefault(url, (reserve, m.id))
                if given[0] != reserve:
                    fail(f"models ({m.id}).batch_reserve", f"{url} has batch_reserve = {reserve} here but "
                         f"{given[0]} in model {given[1]!r}: it is the upstream's, so give it one value")
    org_ids = {o.id for o in orgs}
    seen_keys: set[str] = set()
    for i, key in enumerate(keys):
        if key.org not in org_ids:
            fail(f"keys[{i}].org", f"org {key.org!r} does not exist; add an [[orgs]] entry with id = {key.org!r}")
        for m in key.models or ():
            if m not in model_ids and not any(d.discover and m.startswith(d.id) for d in models):
                fail(f"keys[{i}].models", f"model {m!r} is not in [[models]]")
        if key.key_sha256 in seen_keys:
            fail(f"keys[{i}]", "the same key is listed twice")
        seen_keys.add(key.key_sha256)
