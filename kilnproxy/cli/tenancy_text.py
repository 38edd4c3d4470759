"""How ``kilnproxy orgs`` and ``keys`` print their answers without ``--json``: listings as tables,
one object as ``field: value`` lines. Never given a secret (``keys create`` prints it itself)."""

from __future__ import annotations

from typing import Any, Mapping

ORG_COLUMNS = (("id", "org"), ("source", "source"), ("granted", "granted"), ("spent", "spent"),
               ("held", "held"), ("remaining", "remaining"), ("max_in_flight", "in flight"),
               ("disabled", "disabled"), ("priority", "priority"), ("weight", "weight"))
KEY_COLUMNS = (("id", "key"), ("name", "name"), ("org", "org"), ("role", "role"), ("prefix", "prefix"), ("source", "source"),
               ("status", "status"), ("usage", "usage"), ("limit", "limit"), ("limit_reset", "reset"),
               ("expires_at", "expires"), ("priority", "priority"), ("weight", "weight"))


def cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list):
        return ",".join(value)
    return str(value)


def status(key: Mapping[str, Any]) -> str:
    return "revoked" if key["revoked"] else "disabled" if key["disabled"] else "active"


def table(rows: list[Mapping[str, Any]], columns: tuple[tuple[str, str], ...]) -> str:
    body = [[cell(status(r) if name == "status" else r.get(name)) for name, _ in columns] for r in rows]
    header = [title for _, title in columns]
    widths = [max(len(c) for c in col) for col in zip(header, *body)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in (header, *body))


def fields(obj: Mapping[str, Any]) -> str:
    width = max(len(name) for name in obj)
    return "\n".join(f"{name.ljust(width)}  {cell(value)}" for name, value in obj.items())


def render(out: Mapping[str, Any]) -> str:
    """A listing (``{"data": [...]}``) as a table of its orgs or keys; one object as lines."""
    if "data" not in out:
        return fields(out)
    rows = out["data"]
    if not rows:
        return "none"
    return table(rows, KEY_COLUMNS if "prefix" in rows[0] else ORG_COLUMNS)
