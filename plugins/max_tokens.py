"""max_tokens: a default and a cap for the completion length, per org.

Model servers default ``max_tokens`` to "until the context is full" (vLLM) or
16 (the OpenAI completions default), and a client can ask for anything; this
plugin puts the operator in charge. Install::

    [plugins]
    modules = ["plugins/max_tokens.py"]

    [plugins.settings.max_tokens]
    default = 512           # set when the request gives none (omit: leave such requests alone)
    cap = 4096              # the most a request may ask for (omit: no cap)
    over_cap = "clamp"      # "clamp": lower it to the cap; "reject": 400 max_tokens_too_large

    [plugins.settings.max_tokens.orgs.acme]   # per-org values replace the ones above
    default = 128
    cap = 1024

The field is ``max_tokens`` on /v1/completions; on /v1/chat/completions it is
``max_completion_tokens`` when the client sent that, else ``max_tokens``. A
value that is not a positive integer is left for the model server to refuse.
"""

from __future__ import annotations

from kilnproxy import Refusal, hookimpl

NAME = "max_tokens"
KEYS = ("default", "cap", "over_cap", "orgs")


def limits_for(settings, org: str) -> dict:
    """``default``, ``cap`` and ``over_cap`` for ``org``: its own table over the global one."""
    return {**settings, **settings.get("orgs", {}).get(org, {})}


def field_of(call, body) -> str:
    if call.endpoint == "chat/completions" and "max_completion_tokens" in body:
        return "max_completion_tokens"
    return "max_tokens"


@hookimpl
def startup(gateway):
    settings = gateway.plugin_settings(NAME)
    orgs = settings.get("orgs", {})
    if not isinstance(orgs, dict) or not all(isinstance(t, dict) for t in orgs.values()):
        raise ValueError("[plugins.settings.max_tokens] orgs must hold one table per org: [...orgs.<org>]")
    tables = {"": settings, **{f"orgs.{org}.": t for org, t in settings.get("orgs", {}).items()}}
    for prefix, table in tables.items():
        for key, value in table.items():
            where = f"[plugins.settings.max_tokens] {prefix}{key}"
            if key not in KEYS or (prefix and key == "orgs"):
                raise ValueError(f"{where}: unknown setting; use default, cap, over_cap or orgs.<org>")
            if key in ("default", "cap") and (type(value) is not int or value < 1):
                raise ValueError(f"{where} must be a positive integer")
            if key == "over_cap" and value not in ("clamp", "reject"):
                raise ValueError(f'{where} must be "clamp" or "reject"')


@hookimpl
def check_request(call, body):
    limits = limits_for(call.settings(NAME), call.org)
    cap = limits.get("cap")
    if cap is None or limits.get("over_cap", "clamp") != "reject":
        return None
    field = field_of(call, body)
    asked = body.get(field)
    if type(asked) is int and asked > cap:
        return Refusal(400, "max_tokens_too_large",
                       f"`{field}` is {asked}; org `{call.org}` may ask for at most {cap}.", param=field)
    return None


@hookimpl
def rewrite_request(call, body):
    limits = limits_for(call.settings(NAME), call.org)
    field = field_of(call, body)
    asked = body.get(field)
    cap = limits.get("cap")
    if asked is None:
        if "default" in limits:
            body[field] = min(limits["default"], cap or limits["default"])
        return
    if cap is not None and type(asked) is int and asked > cap:
        body[field] = cap
