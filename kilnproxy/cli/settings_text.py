"""``check-config``'s lines saying where each setting came from: the file, a ``KILNPROXY__*`` variable of
the environment, or the default (kilnproxy.config_env). A secret is never printed: a token (or its hash)
shows as ``<secret>``, a database URL without its password, ``[plugins] settings`` by its tables' names."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from ..config import Config
from ..config_env import DEFAULT, FILE

SECRET_WORDS = ("token", "secret", "password")


def setting_lines(config: Config, every: bool) -> list[str]:
    """``  setting  server.port = 9000 (environment: KILNPROXY__SERVER__PORT)`` for each setting from the
    environment, or for every setting if ``every``."""
    lines = []
    for key, (origin, value) in config.settings.items():
        if origin in (FILE, DEFAULT):
            if every:
                lines.append(f"  setting  {key} = {shown(key, value)} ({origin})")
        else:
            lines.append(f"  setting  {key} = {shown(key, value)} (environment: {origin})")
    return lines


def shown(key: str, value: Any) -> str:
    name = key.rpartition(".")[2]
    if value is None:
        return "none"
    if any(word in name for word in SECRET_WORDS):
        return "<secret>"
    if key == "storage.url":
        return toml_value(without_password(str(value)))
    if key == "plugins.settings":  # free-form tables a plugin reads: they may hold a secret
        return "{" + ", ".join(f"{json.dumps(k) if not k.isidentifier() else k} = {{...}}" for k in value) + "}"
    return toml_value(value)


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    return json.dumps(str(value))


def without_password(url: str) -> str:
    """``url`` with its password (in the user part, or a ``password=`` parameter) replaced by ``***``."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        return "<not a valid URL>"
    netloc = parts.netloc
    if password is not None:
        user, _, host = netloc.rpartition("@")
        netloc = f"{user.partition(':')[0]}:***@{host}"
    query = urlencode([(k, "***" if "pass" in k.lower() else v) for k, v in parse_qsl(parts.query,
                                                                                      keep_blank_values=True)],
                      safe="*")
    return urlunsplit(parts._replace(netloc=netloc, query=query))
