"""Reading one TOML table of the config: names and types checked, errors naming the file and key."""

from __future__ import annotations

import contextvars
import math
from typing import Any
from urllib.parse import SplitResult, urlsplit

from .answers import FORBIDDEN
from .config_types import MAX_USD
from .errors import ConfigError

NUMBER = (int, float)
# The load under way (kilnproxy.config_env.loading sets it): each key's KILNPROXY__<TABLE>__<KEY> variable,
# and where each value read came from. None: the file alone.
SOURCES: contextvars.ContextVar[Any] = contextvars.ContextVar("kilnproxy_config_sources", default=None)


class Reader:
    """Reads one TOML table, checking names and types; errors name file and key.
    A float is never ``nan``, ``inf`` or ``-inf``: no setting means anything by them."""

    def __init__(self, source: str, where: str, table: Any):
        self.source = source
        self.where = where
        if not isinstance(table, dict):
            self.fail(where, f"must be a table, got {type(table).__name__}")
        self.table = table
        self.seen: set[str] = set()

    def fail(self, key: str, problem: str) -> None:
        sources = SOURCES.get()  # a value from the environment: the line names its variable
        raise ConfigError(f"{(sources and sources.origin(key)) or self.source}: {key}: {problem}")

    def key(self, name: str) -> str:
        return f"{self.where}.{name}" if self.where else name

    def get(self, name: str, kind: type | tuple, default: Any = None, *, required: bool = False) -> Any:
        self.seen.add(name)
        kinds = kind if isinstance(kind, tuple) else (kind,)
        sources = SOURCES.get()  # KILNPROXY__<TABLE>__<KEY> wins over the file (docs/config.md)
        if sources is not None:
            from_env, value = sources.read(self.where, name, kinds, name in self.table, self.table.get(name, default))
            if from_env:
                self.table = {**self.table, name: value}
        if name not in self.table:
            if required:
                self.fail(self.key(name), "is required")
            return default
        value = self.table[name]
        if isinstance(value, bool) and bool not in kinds:
            self.fail(self.key(name), f"must be {_describe(kinds)}, got {value!r}")
        if not isinstance(value, kinds):
            self.fail(self.key(name), f"must be {_describe(kinds)}, got {type(value).__name__} {value!r}")
        if isinstance(value, float) and not math.isfinite(value):
            self.fail(self.key(name), f"must be a finite number, got {value!r}")
        return value

    def positive(self, name: str, default: float, *, integer: bool = False) -> Any:
        value = self.get(name, int if integer else NUMBER, default)
        if value <= 0:
            self.fail(self.key(name), f"must be greater than 0, got {value!r}")
        return value

    def usd(self, name: str, default: Any) -> Any:
        """An amount of USD (a price, credits): a number from 0 to ``MAX_USD``."""
        value = self.get(name, NUMBER, default)
        if value is not None and value < 0:
            self.fail(self.key(name), f"must not be negative, got {value!r}")
        if value is not None and value > MAX_USD:
            self.fail(self.key(name), f"must be at most {MAX_USD:,.0f} USD, got {value!r}")
        return value

    def url(self, key: str, url: str, *, port: bool = True, quote: bool = True) -> SplitResult:
        """``url`` split; a malformed host (``http://[::1/v1``) fails naming ``key``, and so does a port that is
        not a number in 0-65535 unless ``port`` is false (a PostgreSQL URL may list several ``host:port``).
        The failure quotes ``url`` only if ``quote`` (a database URL may hold a password)."""
        try:
            parts = urlsplit(url)
            if port:
                parts.port  # noqa: B018 -- the property raises ValueError for a bad port
        except ValueError as exc:
            self.fail(key, f"{url!r} is not a valid URL: {exc}" if quote else f"is not a valid URL: {exc}")
        return parts

    def header(self, name: str, default: str) -> str:
        """The string ``name``, sent as an HTTP header's value: one with a control character fails."""
        value = self.get(name, str, default)
        if not header_safe(value):
            self.fail(self.key(name), f"must not hold a control character (it is sent as an HTTP header), "
                                      f"got {value!r}")
        return value

    def strings(self, name: str, default: Any = None) -> tuple[str, ...] | None:
        value = self.get(name, list, default)
        if value is default:
            return value
        if not all(isinstance(v, str) for v in value):
            self.fail(self.key(name), "must be a list of strings")
        return tuple(value)

    def done(self) -> None:
        unknown = sorted(set(self.table) - self.seen)
        if unknown:
            self.fail(self.key(unknown[0]), "unknown key (check its spelling against config.example.toml)")
        sources = SOURCES.get()
        variable = sources and sources.unknown_in(self.where, self.seen)
        if variable:
            raise ConfigError(f"{variable}: {self.key(variable.rpartition('__')[2].lower())}: unknown key "
                              "(check its spelling against config.example.toml)")


def header_safe(text: str) -> bool:
    """Whether ``text`` can go into an HTTP header as written: no control character but tab (a newline
    would end the header, and aiohttp refuses to send it)."""
    return not FORBIDDEN.search(text)


def _describe(kinds: tuple) -> str:
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string",
             list: "a list", dict: "a table"}
    return " or ".join(dict.fromkeys(names.get(k, k.__name__) for k in kinds))
