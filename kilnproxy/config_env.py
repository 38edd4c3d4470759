"""Every key of the config's tables from the environment: ``KILNPROXY__SECTION__KEY=value`` (docs/config.md).

The rule: ``KILNPROXY__`` + the table's name + ``__`` + the key's name, in capitals
(``KILNPROXY__SERVER__PORT=9000``, ``KILNPROXY__STORAGE__URL_ENV=DATABASE_URL``). A variable
wins over the file's value, and applies with no file at all. A string key takes the
variable's text as written; every other key takes it written as in TOML (``9000``,
``2.5``, ``true``, ``["a", "b"]``, ``{name = "v"}``). The arrays of tables (``[[models]]``,
``[[orgs]]``, ``[[keys]]``) stay in the file.

The loader's ``Reader`` (kilnproxy.config_reader) asks the ``Sources`` of the load under way, key by key, for the variable of each key it reads
(so every key the loader reads is covered, with the type it reads it as), and notes where
each value came from: ``file``, the variable, or ``default`` (``check-config`` shows them).
A variable the loader never asked for is refused as an unknown key or table, naming it.
"""

from __future__ import annotations

import os
import re
import tomllib
from contextlib import contextmanager
from typing import Any, Iterator, Mapping

from .config_reader import SOURCES
from .errors import ConfigError

PREFIX = "KILNPROXY__"
ARRAYS_OF_TABLES = ("models", "orgs", "keys")
FILE = "file"
DEFAULT = "default"
_PLAIN_TABLE = re.compile(r"[a-z][a-z0-9_]*")


def variable(table: str, key: str) -> str:
    """The environment variable of ``table.key``: ``variable("server", "port") == "KILNPROXY__SERVER__PORT"``."""
    return f"{PREFIX}{table.upper()}__{key.upper()}"


class Sources:
    """The ``KILNPROXY__*`` variables of one load of the config, and where each value read came from."""

    def __init__(self, environ: Mapping[str, str] | None):
        self.environ = os.environ if environ is None else environ  # where url_env and headers_env are read
        self.variables = {name.upper(): text for name, text in (environ or {}).items()
                          if name.upper().startswith(PREFIX)}
        self.used: set[str] = set()
        # "server.port" -> (origin, value): origin is FILE, DEFAULT or the variable's name
        self.origins: dict[str, tuple[str, Any]] = {}

    def read(self, table: str, key: str, kinds: tuple, in_file: bool, value: Any) -> tuple[bool, Any]:
        """The value of ``table.key``: ``(True, value)`` from its variable (parsed to ``kinds``), or
        ``(False, value)`` as the file or the default gave it. Notes where it came from."""
        if not _PLAIN_TABLE.fullmatch(table):  # an entry of an array of tables, or a table inside one
            return False, value
        name = variable(table, key)
        if name not in self.variables:
            self.origins[f"{table}.{key}"] = (FILE if in_file else DEFAULT, value)
            return False, value
        self.used.add(name)
        parsed = parse(name, f"{table}.{key}", self.variables[name], kinds)
        self.origins[f"{table}.{key}"] = (name, parsed)
        return True, parsed

    def origin(self, key: str) -> str | None:
        """The variable ``key`` ("server.port", or "plugins.settings.redact" inside one) came from, if it did."""
        while key:
            found = self.origins.get(key)
            if found:
                return found[0] if found[0].startswith(PREFIX) else None
            key = key.rpartition(".")[0]
        return None

    def unknown_in(self, table: str, seen: set[str]) -> str | None:
        """A variable of ``table`` naming a key the loader did not read there (the first, sorted)."""
        if not _PLAIN_TABLE.fullmatch(table):
            return None
        start = f"{PREFIX}{table.upper()}__"
        names = sorted(n for n in self.variables if n.startswith(start) and n not in self.used
                       and n[len(start):] and "__" not in n[len(start):] and n[len(start):].lower() not in seen)
        return names[0] if names else None

    def check_all_used(self) -> None:
        """Refuses the first variable (sorted) that no table of the loader took."""
        for name in sorted(set(self.variables) - self.used):
            parts = name[len(PREFIX):].lower().split("__")
            if len(parts) != 2 or not all(parts):
                raise ConfigError(f"{name}: not a config key: the rule is {PREFIX}<TABLE>__<KEY>, e.g. "
                                  f"{PREFIX}SERVER__PORT=8080")
            table, key = parts
            if table in ARRAYS_OF_TABLES:
                raise ConfigError(f"{name}: [[{table}]] is an array of tables: it stays in the config file")
            raise ConfigError(f"{name}: {table}: unknown table (check its spelling against config.example.toml)")


def parse(name: str, key: str, text: str, kinds: tuple) -> Any:
    """A variable's text as a value of ``kinds``: a string key takes it as written, any other key as TOML."""
    if str in kinds:
        return text
    try:
        value = tomllib.loads(f"v = {text}")["v"] if "\n" not in text and "\r" not in text else None
    except tomllib.TOMLDecodeError:
        value = None
    if value is None:
        if list in kinds or dict in kinds:  # may hold a secret: the text is not quoted back
            what = "a TOML array, e.g. [\"a\", \"b\"]" if list in kinds else "a TOML inline table, e.g. {a = 1}"
            raise ConfigError(f"{name}: {key}: must be {what}")
        what = "true or false" if bool in kinds else "a number" if float in kinds else "an integer"
        raise ConfigError(f"{name}: {key}: must be {what}, got {text!r}")
    return value


@contextmanager
def loading(environ: Mapping[str, str] | None) -> Iterator[Sources]:
    """While the config is read: the readers take their keys' variables from ``environ``."""
    sources = Sources(environ)
    token = SOURCES.set(sources)
    try:
        yield sources
    finally:
        SOURCES.reset(token)


def getenv(name: str) -> str | None:
    """The variable ``name`` (one a key names, as ``[storage] url_env``) of the environment being loaded."""
    sources = SOURCES.get()
    return (os.environ if sources is None else sources.environ).get(name)
