"""The operator's tables of the config: ``[admin]``, ``[metrics]``, ``[log]``, ``[health]``,
``[inspector]`` and ``[tracing]`` (docs/config.md)."""

from __future__ import annotations

from . import config_env
from .answers import HEADER_NAME
from .config_reader import NUMBER, Reader, header_safe
from .config_types import (
    AdminConfig,
    HealthConfig,
    InspectorConfig,
    LogConfig,
    MetricsConfig,
    TracingConfig,
    sha256_hex,
)


def operations(source: str, top: Reader) -> tuple[AdminConfig, MetricsConfig, LogConfig, HealthConfig]:
    """The ``[admin]``, ``[metrics]``, ``[log]`` and ``[health]`` tables."""
    r = Reader(source, "admin", top.get("admin", dict, {}))
    token = r.get("token", str, None)
    digest = r.get("token_sha256", str, None)
    if token is not None and digest is not None:
        r.fail(r.key("token"), "give token or token_sha256, not both")
    if token is not None and not token.strip():
        r.fail(r.key("token"), "must not be empty")
    if digest is not None:
        digest = digest.lower()
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            r.fail(r.key("token_sha256"), "must be 64 hex digits (sha256 of the token)")
    admin = AdminConfig(digest or (sha256_hex(token) if token is not None else None),
                        r.get("allow_loopback", bool, True))
    r.done()
    r = Reader(source, "metrics", top.get("metrics", dict, {}))
    metrics = MetricsConfig(r.get("enabled", bool, True))
    r.done()
    r = Reader(source, "log", top.get("log", dict, {}))
    log = LogConfig(r.get("access", bool, True), r.get("bodies", bool, False))
    r.done()
    r = Reader(source, "health", top.get("health", dict, {}))
    interval = r.get("interval", NUMBER, HealthConfig.interval)
    if interval < 0:
        r.fail(r.key("interval"), f"must be 0 (no active checks) or more, got {interval!r}")
    path = r.get("path", str, HealthConfig.path)
    if not path.startswith("/"):
        r.fail(r.key("path"), f"must start with '/', e.g. \"/health\" or \"/v1/models\", got {path!r}")
    health = HealthConfig(float(interval), path, float(r.positive("timeout", HealthConfig.timeout)))
    r.done()
    return admin, metrics, log, health


def inspector(r: Reader) -> InspectorConfig:
    d = InspectorConfig()
    token = r.get("token", str, None)
    if token is not None and not token.strip():
        r.fail(r.key("token"), "must not be empty (leave it out to allow loopback clients only)")
    inspector = InspectorConfig(
        enabled=r.get("enabled", bool, d.enabled),
        capture=r.get("capture", bool, d.capture),
        capture_requests=r.positive("capture_requests", d.capture_requests, integer=True),
        capture_bytes=r.positive("capture_bytes", d.capture_bytes, integer=True),
        token=token,
    )
    r.done()
    return inspector


def tracing(r: Reader) -> TracingConfig:
    d = TracingConfig()
    endpoint = r.get("endpoint", str, d.endpoint)
    parsed = r.url(r.key("endpoint"), endpoint)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        r.fail(r.key("endpoint"), f"must be an http(s) URL, e.g. \"{d.endpoint}\", got {endpoint!r}")
    headers_env = r.get("headers_env", str, None)
    headers: list[tuple[str, str]] = []
    if headers_env is not None:
        for item in filter(None, (p.strip() for p in (config_env.getenv(headers_env) or "").split(","))):
            name, eq, value = item.partition("=")
            if not eq or not name.strip():
                r.fail(r.key("headers_env"), f"the variable {headers_env} must hold name=value pairs separated "
                                             "by commas (the value is not shown)")
            if not HEADER_NAME.fullmatch(name.strip()):
                r.fail(r.key("headers_env"), f"the variable {headers_env} names a header {name.strip()!r} that is "
                                             "not an HTTP header name (letters, digits and !#$%&'*+-.^_`|~)")
            if not header_safe(item):
                r.fail(r.key("headers_env"), f"the variable {headers_env} holds a control character in header "
                                             f"{name.strip()!r} (the value is not shown)")
            headers.append((name.strip(), value.strip()))
    ratio = r.get("sample_ratio", NUMBER, d.sample_ratio)
    if not 0 <= ratio <= 1:
        r.fail(r.key("sample_ratio"), f"must be between 0 and 1, got {ratio!r}")
    service = r.get("service_name", str, d.service_name)
    if not service.strip():
        r.fail(r.key("service_name"), "must not be empty")
    trace_url = r.get("trace_url", str, None)
    trace_scheme = None if trace_url is None else r.url(r.key("trace_url"), trace_url).scheme
    if trace_url is not None and (trace_scheme not in ("http", "https") or "{trace_id}" not in trace_url):
        r.fail(r.key("trace_url"), "must be an http(s) URL with {trace_id} in it, e.g. "
                                   f"\"https://grafana.example/explore?traceId={{trace_id}}\", got {trace_url!r}")
    tracing = TracingConfig(enabled=r.get("enabled", bool, d.enabled), endpoint=endpoint, headers_env=headers_env,
                            headers=tuple(headers), sample_ratio=float(ratio), service_name=service,
                            timeout=float(r.positive("timeout", d.timeout)),
                            max_queue_size=r.positive("max_queue_size", d.max_queue_size, integer=True),
                            trace_url=trace_url)
    r.done()
    return tracing
