"""The config as frozen dataclasses: what every part of the gateway reads.

Built and validated only by ``kilnproxy.config`` (``load_config``); defaults
here are the documented defaults of ``config.example.toml``.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    max_request_bytes: int = 4 * 1024 * 1024
    keepalive_seconds: float = 15.0
    upstream_connect_timeout: float = 10.0
    upstream_idle_timeout: float = 600.0
    upstream_max_failures: int = 3
    upstream_down_seconds: float = 10.0
    shutdown_grace_seconds: float = 30.0
    drain_seconds: float = 5.0  # after SIGTERM: not ready, still serving, each connection closed after its response
    request_body_timeout: float = 30.0  # seconds to receive a request's whole body
    # Seconds a pooled upstream connection may sit idle before the gateway closes it: below the model
    # servers' own (vLLM and uvicorn close idle connections after 5 s), so that a request is never sent
    # on a connection the server is closing at that moment.
    upstream_keepalive_timeout: float = 4.0


@dataclass(frozen=True)
class StorageConfig:
    """SQLite at ``path`` (one process), or PostgreSQL at ``url`` shared by several replicas."""

    path: str = "kilnproxy.db"
    url: str | None = None  # from ``url`` or the variable named by ``url_env``
    url_env: str | None = None
    replica_timeout_seconds: float = 15.0
    spool_path: str = "kilnproxy-spool.db"


@dataclass(frozen=True)
class LimitsConfig:
    max_in_flight_per_org: int = 8


@dataclass(frozen=True)
class MaintenanceConfig:
    enabled: bool = False
    retry_after: str = "Mon, 30 Nov 2026 06:00:00 GMT"


# The most a price (USD per million tokens), an org's credits or a grant may be, either way: with token
# counts of 64 bits, no cost, and no sum of credits and grants, can then overflow a double to ``inf``.
MAX_USD = 1e12


@dataclass(frozen=True)
class Pricing:
    """USD per million tokens, each from 0 to ``MAX_USD`` (the config's reader checks it)."""

    prompt: float = 0.0
    completion: float = 0.0
    cached_prompt: float | None = None
    batch_discount: float = 1.0  # the factor of a Batch API line's prices (SPEC 14), from 0 to 1

    @functools.cached_property
    def for_batch(self) -> "Pricing":
        """The prices of a Batch API line: each × ``batch_discount`` (made once, at the first line)."""
        if self.batch_discount == 1.0:
            return self
        d = self.batch_discount
        cached = None if self.cached_prompt is None else self.cached_prompt * d
        return Pricing(self.prompt * d, self.completion * d, cached, 1.0)

    def cost(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> float:
        cached = min(max(cached_tokens, 0), prompt_tokens)
        cached_rate = self.prompt if self.cached_prompt is None else self.cached_prompt
        micro = (prompt_tokens - cached) * self.prompt + cached * cached_rate
        micro += completion_tokens * self.completion
        return micro / 1_000_000


@dataclass(frozen=True)
class ModelConfig:
    id: str
    upstreams: tuple[str, ...]
    upstream_model: str
    upstream_api_key_env: str | None = None
    context_window: int | None = None
    reject_chat_params: tuple[str, ...] = ()
    pricing: Pricing = Pricing()
    # The traffic controls of a fleet (docs/reference.md, "Traffic control"):
    upstream_max_in_flight: tuple[int | None, ...] = ()  # per entry of ``upstreams``; None: no cap
    fallbacks: tuple[str, ...] = ()  # catalog ids tried in order when no upstream can take a request
    first_byte_timeout: float | None = None  # seconds for an upstream to begin its answer
    request_timeout: float | None = None  # seconds from admission to the end of the answer
    queue_timeout: float = 0.0  # seconds a request may wait for a free upstream slot
    # How a request picks among the upstreams (docs/reference.md, "Routing"):
    routing: str = "least_busy"  # one of ROUTING
    cache_aware_slack: float = 0.25  # cache_aware: how far above the mean load an upstream may still take its keys
    load_poll: float = 1.0  # seconds between reads of each upstream server's own load; 0: none

    endpoints: tuple[str, ...] = ("completions", "chat/completions")  # the APIs this model answers
    discover: bool = False  # id is a prefix: the upstreams' own /v1/models list is served under it
    alias: str | None = None  # with discover: the first model listed is also served under this id

    # SPEC 14: the free slots of a capped upstream that batch-priority requests leave; per entry of
    # ``upstreams`` (its table's ``batch_reserve``, else the model's), None: not given (the default)
    upstream_batch_reserve: tuple[int | None, ...] = ()

    def max_in_flight_of(self, index: int) -> int | None:
        return self.upstream_max_in_flight[index] if index < len(self.upstream_max_in_flight) else None

    def batch_reserve_given(self, index: int) -> int | None:
        """The ``batch_reserve`` this model gives its ``index``-th upstream, or None (not given)."""
        return self.upstream_batch_reserve[index] if index < len(self.upstream_batch_reserve) else None

    def batch_reserve_of(self, index: int) -> int:
        """The ``index``-th upstream's ``batch_reserve`` as this model sees it: given, else 1 where its
        ``max_in_flight`` is 2 or more, else 0 (no cap: no queue, 0)."""
        given = self.batch_reserve_given(index)
        return given if given is not None else default_batch_reserve(self.max_in_flight_of(index))


def default_batch_reserve(max_in_flight: int | None) -> int:
    return 1 if max_in_flight is not None and max_in_flight >= 2 else 0


# The routing policies of a model's upstreams.
ROUTING = ("least_busy", "cache_aware", "round_robin")


# The APIs a model may serve, by the names the usage rows' ``endpoint`` column uses.
ROLES = ("admin", "member")  # a key's role: an admin key may also call the org API (/v1/org)
ENDPOINTS = ("completions", "chat/completions", "embeddings", "responses", "messages")


# A request's priority for upstream slots (SPEC 14): orgs and keys have one; "interactive" is the default.
PRIORITIES = ("interactive", "batch")
MAX_WEIGHT = 1e6  # an org's (or key's) weight is a number above 0 and at most this


@dataclass(frozen=True)
class OrgConfig:
    id: str
    credits: float = 0.0
    max_in_flight: int | None = None
    requests_per_minute: int | None = None  # admitted over any 60 s, across replicas; None: no bound
    tokens_per_minute: int | None = None  # prompt + completion tokens, reserved at admission, then settled
    priority: str = "interactive"  # one of PRIORITIES: its keys' requests' priority, unless a key has its own
    weight: float = 1.0  # its share of an upstream's slots while orgs wait for them (fair queues)


@dataclass(frozen=True)
class KeyConfig:
    """A key as authentication sees it: one of the config's, or one made at runtime (``source = "api"``).

    ``expires_at`` is a POSIX time (None: never); ``limit`` USD per ``limit_reset`` period
    (``daily``, ``weekly``, ``monthly``, or None: since ``created_at``)."""

    key_sha256: str
    org: str
    id: str
    models: tuple[str, ...] | None = None
    disabled: bool = False
    prefix: str | None = None  # the secret's first 8 characters; None for a config key given by its hash
    name: str | None = None
    source: str = "config"
    expires_at: float | None = None
    limit: float | None = None
    limit_reset: str | None = None
    created_at: str | None = None
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    # SPEC 14 (None: the org's). A request authenticated as this key runs at ``priority`` ("batch": its
    # waits for upstream slots come after every interactive request's); the Batch API's runner runs each
    # line as ``dataclasses.replace(key, priority="batch")``. ``weight`` counts the key's requests in its
    # org's fair share (``Gateway.claim_of``).
    priority: str | None = None
    weight: float | None = None
    role: str = "member"  # or "admin": the key may also call the org API (/v1/org) of its org


@dataclass(frozen=True)
class BatchesConfig:
    """The Batch API (``[batches]``): lines run at once by this replica, the largest file uploaded."""

    max_in_flight: int = 4
    max_file_bytes: int = 100 * 1024 * 1024


@dataclass(frozen=True)
class PluginsConfig:
    modules: tuple[str, ...] = ()
    entry_points: bool = True
    settings: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)


@dataclass(frozen=True)
class AdminConfig:
    """Who may read /metrics and call /admin/*: the bearer ``token`` and/or loopback clients."""

    token_sha256: str | None = None
    allow_loopback: bool = True


@dataclass(frozen=True)
class MetricsConfig:
    enabled: bool = True


@dataclass(frozen=True)
class LogConfig:
    access: bool = True
    bodies: bool = False


@dataclass(frozen=True)
class HealthConfig:
    interval: float = 10.0  # seconds between active checks; 0: none
    path: str = "/health"
    timeout: float = 5.0


@dataclass(frozen=True)
class InspectorConfig:
    """The web inspector at /ui (kilnproxy.inspector)."""

    enabled: bool = True
    capture: bool = False  # keep bodies and streams of the last requests in memory
    capture_requests: int = 100
    capture_bytes: int = 1024 * 1024  # per request; beyond it the capture is marked truncated
    token: str | None = None  # None: loopback clients only


@dataclass(frozen=True)
class TracingConfig:
    """OpenTelemetry traces sent over OTLP/HTTP (kilnproxy.ops.tracing.install; the ``tracing`` extra)."""

    enabled: bool = False
    endpoint: str = "http://127.0.0.1:4318/v1/traces"
    headers_env: str | None = None  # a variable holding "name=value,name2=value2" (e.g. an API key)
    headers: tuple[tuple[str, str], ...] = ()  # read from headers_env at load time
    sample_ratio: float = 1.0  # of the traces that start here; a client's sampled flag is followed
    service_name: str = "kilnproxy"
    timeout: float = 5.0  # seconds one export may take, its retries included
    max_queue_size: int = 2048  # spans waiting for their export; beyond, the oldest are dropped
    trace_url: str | None = None  # the inspector links each request to this, "{trace_id}" replaced


@dataclass(frozen=True)
class Config:
    server: ServerConfig = ServerConfig()
    storage: StorageConfig = StorageConfig()
    limits: LimitsConfig = LimitsConfig()
    maintenance: MaintenanceConfig = MaintenanceConfig()
    models: tuple[ModelConfig, ...] = ()
    orgs: tuple[OrgConfig, ...] = ()
    keys: tuple[KeyConfig, ...] = ()
    plugins: PluginsConfig = PluginsConfig()
    admin: AdminConfig = AdminConfig()
    metrics: MetricsConfig = MetricsConfig()
    log: LogConfig = LogConfig()
    health: HealthConfig = HealthConfig()
    inspector: InspectorConfig = InspectorConfig()
    tracing: TracingConfig = TracingConfig()
    batches: BatchesConfig = BatchesConfig()
    base_dir: Path = Path(".")
    source: str = "<built-in>"
    # "server.port" -> (where its value came from: "file", "default" or a KILNPROXY__ variable, the value),
    # for every key of the tables outside [[models]], [[orgs]] and [[keys]] (kilnproxy.config_env)
    settings: Mapping[str, tuple[str, Any]] = field(default_factory=dict, compare=False, repr=False)

    def resolve(self, relative: str) -> Path:
        """A path from the config, relative to the config file's folder."""
        p = Path(relative)
        return p if p.is_absolute() else self.base_dir / p

    @property
    def db_path(self) -> Path:
        return self.resolve(self.storage.path)

    @property
    def spool_path(self) -> Path:
        return self.resolve(self.storage.spool_path)


def sha256_hex(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()
