"""Strict checks of the bodies that change orgs, keys and grants, as pure functions.

The admin API (``/admin/v1``), the org API (``/v1/org``: an org's own admin
keys, which may set neither an org nor a key's per-minute limits), the
inspector and the ``orgs`` / ``keys`` commands hand their input here before
anything touches the store. Each function takes the
parsed JSON body and returns the fields it may change, normalised (a limit
as a float, ``expires_at`` as ISO-8601 UTC text, the same form as the usage
rows' ``created_at``); a patch returns only the fields it was given. Any
refusal is ``GatewayError(400, "invalid_request", message, param=<field>)``
— ``param`` is None only when the body itself is not a JSON object — so a
refused request changes nothing.

``query(request, *allowed)`` refuses a query parameter a route does not take,
the same way (``param``: its name).

Checked in this order: the body is an object, no unknown field, no missing
required field, then each field (in a fixed order, the first fault answers).
"""

from __future__ import annotations

import json
import re
from datetime import datetime, timezone
from typing import Any, Callable

import orjson

from ...config_types import MAX_USD, MAX_WEIGHT, PRIORITIES, ROLES
from ...errors import GatewayError

LIMIT_RESETS = ("daily", "weekly", "monthly")
ORG_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}")
MAX_TEXT = 200  # characters of a name or a reference
MAX_INT = 2**63 - 1  # a per-minute limit: what a BIGINT (and SQLite's INTEGER) holds
MAX_IN_FLIGHT = 2**31 - 1  # what PostgreSQL's INTEGER column of max_in_flight holds


def storable(text: str) -> bool:
    """Whether both stores can keep ``text``: PostgreSQL's text holds no NUL (and refuses a
    parameter with one), so no stored id has one and no name or reference may."""
    return "\x00" not in text


def invalid(message: str, param: str | None) -> GatewayError:
    return GatewayError(400, "invalid_request", message, param=param)


def parse_body(raw: bytes) -> dict[str, Any]:
    """The JSON object of a request body, or 400 (not JSON, not an object). What orjson refuses is
    read again by the json module, as a model server reads a body: a number beyond a double (read as
    ``inf``, an integer beyond 64 bits as itself) so that its field's check names the field, and a
    leading UTF-8 byte order mark."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        try:
            body = json.loads(raw.decode("utf-8-sig"), parse_constant=_not_json)
        except (ValueError, RecursionError):
            raise invalid("The body is not valid JSON.", None) from None
    return _object(body)


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


def iso_utc(moment: datetime) -> str:
    """``moment`` as the stores write times: ``2026-11-29T20:00:00.123+00:00`` (UTC, milliseconds,
    a 4-digit year), so that comparing the texts compares the times. ``OverflowError`` when the
    UTC time falls outside years 1 to 9999."""
    moment = moment.astimezone(timezone.utc)
    return f"{moment.year:04d}" + moment.strftime("-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}+00:00"


# -- one field each: (value, field name) -> the value to store -------------------------------------

def _text(value: Any, field: str) -> str:
    if not isinstance(value, str):
        raise invalid(f"`{field}` must be a string.", field)
    if not value.strip():
        raise invalid(f"`{field}` must not be empty.", field)
    if len(value) > MAX_TEXT:
        raise invalid(f"`{field}` must be at most {MAX_TEXT} characters.", field)
    if not storable(value):
        raise invalid(f"`{field}` must not contain a NUL character.", field)
    return value


def _org_id(value: Any, field: str) -> str:
    if not isinstance(value, str) or not ORG_ID.fullmatch(value):
        raise invalid(f"`{field}` must be a string of 1 to 64 letters, digits, '.', '_', ':' or '-', "
                      "beginning with a letter or digit.", field)
    return value


def _positive_int(value: Any, field: str, high: int = MAX_INT) -> int | None:
    if value is None:
        return None
    if type(value) is not int or not 0 < value <= high:
        raise invalid(f"`{field}` must be an integer from 1 to {high}, or null for none.", field)
    return value


def _in_flight(value: Any, field: str) -> int | None:
    return _positive_int(value, field, MAX_IN_FLIGHT)


def _flag(value: Any, field: str) -> bool:
    if not isinstance(value, bool):
        raise invalid(f"`{field}` must be true or false.", field)
    return value


def _usd(value: Any, field: str) -> float:
    if type(value) not in (int, float):
        raise invalid(f"`{field}` must be a JSON number of USD (not a string).", field)
    if not -MAX_USD <= value <= MAX_USD:  # also inf, nan and an integer no double holds
        raise invalid(f"`{field}` must be at most {MAX_USD:,.0f} USD, either way.", field)
    return float(value)


def _limit(value: Any, field: str) -> float | None:
    if value is None:
        return None
    amount = _usd(value, field)
    if amount < 0:
        raise invalid(f"`{field}` must not be negative (null for no limit).", field)
    return amount


def _limit_reset(value: Any, field: str) -> str | None:
    if value is not None and value not in LIMIT_RESETS:
        raise invalid(f"`{field}` must be one of daily, weekly, monthly, or null (never reset).", field)
    return value


def _expires_at(value: Any, field: str) -> str | None:
    if value is None:
        return None
    try:
        moment = datetime.fromisoformat(value) if isinstance(value, str) else None
    except ValueError:
        moment = None
    if moment is None:
        raise invalid(f"`{field}` must be an ISO-8601 date and time, e.g. 2026-12-31T23:59:59Z, "
                      "or null for never.", field)
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    try:
        return iso_utc(moment)
    except OverflowError:
        raise invalid(f"`{field}` is out of range once converted to UTC (years 1 to 9999).", field) from None


def _role(value: Any, field: str) -> str:
    if value not in ROLES:
        raise invalid(f"`{field}` must be admin or member.", field)
    return value


def _models(value: Any, field: str) -> list[str] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not value or not all(isinstance(m, str) and m for m in value):
        raise invalid(f"`{field}` must be a non-empty list of model ids, or null for every model.", field)
    return list(dict.fromkeys(value))


def _priority(value: Any, field: str) -> str:
    if value not in PRIORITIES:
        raise invalid(f"`{field}` must be one of {', '.join(PRIORITIES)}.", field)
    return value


def _key_priority(value: Any, field: str) -> str | None:
    if value is not None and value not in PRIORITIES:
        raise invalid(f"`{field}` must be one of {', '.join(PRIORITIES)}, or null for its org's.", field)
    return value


def _weight(value: Any, field: str) -> float:
    if type(value) not in (int, float) or not 0 < value <= MAX_WEIGHT:  # also nan, inf and a bool
        raise invalid(f"`{field}` must be a number above 0 and at most {MAX_WEIGHT:g}.", field)
    return float(value)


def _key_weight(value: Any, field: str) -> float | None:
    if value is None:
        return None
    if type(value) not in (int, float) or not 0 < value <= MAX_WEIGHT:
        raise invalid(f"`{field}` must be a number above 0 and at most {MAX_WEIGHT:g}, or null for its org's.",
                      field)
    return float(value)


Check = Callable[[Any, str], Any]

_ORG_LIMITS: dict[str, Check] = {
    "max_in_flight": _in_flight, "requests_per_minute": _positive_int, "tokens_per_minute": _positive_int,
    "priority": _priority, "weight": _weight}
# what an org's own admin may set on its keys (the org API); the per-minute limits, and the priority and
# weight that make an org's share of the upstreams, stay the operator's
_OWN_KEY_FIELDS: dict[str, Check] = {
    "name": _text, "models": _models, "limit": _limit, "limit_reset": _limit_reset, "expires_at": _expires_at,
    "role": _role}
_KEY_FIELDS: dict[str, Check] = {
    **_OWN_KEY_FIELDS, "requests_per_minute": _positive_int, "tokens_per_minute": _positive_int,
    "priority": _key_priority, "weight": _key_weight}

ORG_CREATE: dict[str, Check] = {"id": _org_id, **_ORG_LIMITS}
ORG_PATCH: dict[str, Check] = {**_ORG_LIMITS, "disabled": _flag}
GRANT_CREATE: dict[str, Check] = {"amount": _usd, "reference": _text}
KEY_CREATE: dict[str, Check] = {"org": _text, **_KEY_FIELDS}
KEY_PATCH: dict[str, Check] = {**_KEY_FIELDS, "disabled": _flag}
OWN_KEY_CREATE: dict[str, Check] = _OWN_KEY_FIELDS
OWN_KEY_PATCH: dict[str, Check] = {**_OWN_KEY_FIELDS, "disabled": _flag}


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise invalid("The body must be a JSON object.", None)
    return body


def _checked(body: Any, fields: dict[str, Check], required: tuple[str, ...] = (),
             defaults: bool = False) -> dict[str, Any]:
    body = _object(body)
    for name in body:
        if name not in fields:
            raise invalid(f"Unknown field `{name}`; the fields are: {', '.join(fields)}.", name)
    for name in required:
        if name not in body:
            raise invalid(f"`{name}` is required.", name)
    return {name: check(body[name], name) if name in body else None
            for name, check in fields.items() if name in body or defaults}


def org_create(body: Any) -> dict[str, Any]:
    """POST /admin/v1/orgs: ``id`` and the optional limits, ``priority`` and ``weight`` (None when not given)."""
    return _checked(body, ORG_CREATE, required=("id",), defaults=True)


def org_patch(body: Any) -> dict[str, Any]:
    """PATCH /admin/v1/orgs/{id}: the limits and ``disabled`` given."""
    return _checked(body, ORG_PATCH)


def grant_create(body: Any) -> dict[str, Any]:
    """POST /admin/v1/orgs/{id}/grants: ``amount`` (a float, may be negative) and ``reference``."""
    return _checked(body, GRANT_CREATE, required=("amount", "reference"))


def key_create(body: Any, org: str | None = None) -> dict[str, Any]:
    """POST /admin/v1/keys: ``org``, ``name`` and the optional fields (None when not given). With
    ``org`` (POST /v1/org/keys, an org's own admin): the body names no org and no per-minute limit,
    and the fields answered have ``org`` set to it."""
    if org is None:
        return _checked(body, KEY_CREATE, required=("org", "name"), defaults=True)
    return {"org": org, **_checked(body, OWN_KEY_CREATE, required=("name",), defaults=True)}


def key_patch(body: Any, own: bool = False) -> dict[str, Any]:
    """PATCH /admin/v1/keys/{id}: any of name, models, limit, limit_reset, expires_at, disabled, role
    and the per-minute limits, as given; ``own`` (PATCH /v1/org/keys/{id}): not the per-minute limits."""
    return _checked(body, OWN_KEY_PATCH if own else KEY_PATCH)
