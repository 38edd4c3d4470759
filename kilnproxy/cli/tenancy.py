"""``kilnproxy orgs ...`` and ``kilnproxy keys ...``: runtime orgs, keys and grants from the command line.

They open the store the config names (``--config FILE``, or
``$KILNPROXY_CONFIG``): the SQLite file or PostgreSQL, whether or not a
gateway runs; with no config, the demo's store (``./kilnproxy.db``, its org ``demo``); a running gateway sees the change within a second by itself.
The checks and rules are the admin API's (``kilnproxy.proxy.tenancy.changes``):
the same 400 / 404 / 409 refusals, printed as one line on stderr with exit
status 2, and nothing changed. Audit events name the actor ``cli``.

Output is a table or ``field: value`` lines; ``--json`` prints the admin API's
bodies instead (``{"data": [...]}`` for a listing, the object for one).
``keys create`` prints the secret once; nothing else ever prints it.

In an option's value, ``none`` clears a field (no limit, no expiry, the
default ``max_in_flight``, a key's ``priority`` or ``weight`` taken from its org); ``--models all`` lifts a key's allow-list, and an
empty ``--models`` is refused.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any, Callable, NoReturn

from ..config import load_config
from ..errors import GatewayError, KilnError, StorageError
from ..proxy.tenancy.changes import TenancyChanges, is_store_outage
from ..proxy.tenancy.views import Books, TenancyView
from ..store.reads import reason
from ..store.books import open_command_store
from .demo import demo_config
from .tenancy_text import render

ACTOR = "cli"
CLEAR = "none"


# -- option values ---------------------------------------------------------------------------------

def _number(kind: Callable[[str], Any], what: str) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        if text.lower() == CLEAR:
            return None
        try:
            return kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what} or {CLEAR}, not {text!r}") from None
    return parse


WHOLE = _number(int, "a whole number")
USD = _number(float, "an amount in USD")
WEIGHT = _number(float, "a number")


def _text_or_none(text: str) -> str | None:
    return None if text.lower() == CLEAR else text


def _flag(text: str) -> bool:
    if text.lower() not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"expected true or false, not {text!r}")
    return text.lower() == "true"


def _models(text: str) -> list[str] | None:
    """``all``: None, the allow-list lifted; else the comma-separated model ids. An empty value is
    refused, so that an unset shell variable (``--models "$MODELS"``) never lifts the allow-list."""
    if text.strip().lower() == "all":
        return None
    if not text.strip():
        raise argparse.ArgumentTypeError("expected model ids separated by commas, or all to lift the allow-list,"
                                         f" not {text!r}")
    return [m.strip() for m in text.split(",")]


def _amount(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an amount in USD, e.g. 25 or -2.5, not {text!r}") from None


# -- the parser --------------------------------------------------------------------------------------

ORG_OPTIONS = (("--max-in-flight", WHOLE), ("--requests-per-minute", WHOLE), ("--tokens-per-minute", WHOLE),
               ("--priority", str), ("--weight", WEIGHT))
KEY_OPTIONS = (("--name", str), ("--models", _models), ("--limit", USD), ("--limit-reset", _text_or_none),
               ("--expires-at", _text_or_none), ("--requests-per-minute", WHOLE), ("--tokens-per-minute", WHOLE),
               ("--priority", _text_or_none), ("--weight", WEIGHT), ("--role", str))


def add_tenancy_commands(sub: Any, config_arg: Callable[[argparse.ArgumentParser], None]) -> None:
    def command(group: Any, name: str, help: str, action: Callable) -> argparse.ArgumentParser:
        p = one_line_errors(group.add_parser(name, help=help))
        config_arg(p)
        p.add_argument("--json", action="store_true", help="print the admin API's JSON instead of text")
        p.set_defaults(func=lambda args: run(args, action))
        return p

    def options(p: argparse.ArgumentParser, table: tuple, skip: tuple = ()) -> None:
        for flag, kind in table:
            if flag not in skip:
                p.add_argument(flag, type=kind, default=argparse.SUPPRESS, metavar=flag[2:].upper().replace("-", "_"))

    orgs = one_line_errors(sub.add_parser("orgs", help="runtime orgs and their credit grants, in the config's store"))
    verbs = orgs.add_subparsers(dest="action", required=True, metavar="{create,list,show,update,grant}")
    p = command(verbs, "create", "make an org", create_org)
    p.add_argument("id")
    options(p, ORG_OPTIONS)
    command(verbs, "list", "every org (the config's too), with its credits", list_orgs)
    command(verbs, "show", "one org", show_org).add_argument("id")
    p = command(verbs, "update", "change an org made at runtime", update_org)
    p.add_argument("id")
    options(p, ORG_OPTIONS)
    p.add_argument("--disabled", type=_flag, default=argparse.SUPPRESS, metavar="true|false")
    p = command(verbs, "grant", "credit an org with AMOUNT USD, once per --reference", grant)
    p.add_argument("id")
    p.add_argument("amount", type=_amount)
    p.add_argument("--reference", required=True, help="unique within the org: a second grant of it adds nothing")

    keys = one_line_errors(sub.add_parser("keys", help="runtime API keys, in the config's store"))
    verbs = keys.add_subparsers(dest="action", required=True, metavar="{create,list,show,update,revoke}")
    p = command(verbs, "create", "make a key and print its secret (once)", create_key)
    p.add_argument("--org", required=True)
    p.add_argument("--name", required=True)
    options(p, KEY_OPTIONS, skip=("--name",))
    command(verbs, "list", "every key (the config's too), with its usage", list_keys).add_argument("--org")
    command(verbs, "show", "one key", show_key).add_argument("key_id")
    p = command(verbs, "update", "change a key made at runtime", update_key)
    p.add_argument("key_id")
    options(p, KEY_OPTIONS)
    p.add_argument("--disabled", type=_flag, default=argparse.SUPPRESS, metavar="true|false")
    command(verbs, "revoke", "revoke a key for good (its usage rows stay)", revoke_key).add_argument("key_id")


def one_line_errors(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """A usage error as one line on stderr (``kilnproxy: error: ...``), exit status 2, as every refusal."""

    def error(message: str) -> NoReturn:
        p.exit(2, f"kilnproxy: error: {p.prog.partition('kilnproxy ')[2]}: {message} (see --help)\n")

    p.error = error  # type: ignore[method-assign]
    return p


def body_of(args: argparse.Namespace, *names: str) -> dict[str, Any]:
    """The admin API's body from the options given (an option not given is not in it)."""
    return {name: getattr(args, name) for name in names if hasattr(args, name)}


ORG_FIELDS = ("max_in_flight", "requests_per_minute", "tokens_per_minute", "priority", "weight")
KEY_FIELDS = ("name", "models", "limit", "limit_reset", "expires_at", "requests_per_minute", "tokens_per_minute",
              "priority", "weight", "role")


# -- the actions: (args, changes) -> what to print ----------------------------------------------------------

async def create_org(args, changes: TenancyChanges) -> Any:
    return await changes.create_org({"id": args.id, **body_of(args, *ORG_FIELDS)})


async def list_orgs(args, changes: TenancyChanges) -> Any:
    return {"data": await changes.view.orgs()}


async def show_org(args, changes: TenancyChanges) -> Any:
    return await changes.org(args.id)


async def update_org(args, changes: TenancyChanges) -> Any:
    return await changes.update_org(args.id, body_of(args, *ORG_FIELDS, "disabled"))


async def grant(args, changes: TenancyChanges) -> Any:
    grant, created = await changes.add_grant(args.id, {"amount": args.amount, "reference": args.reference})
    if not created and not args.json:
        print(f"reference {grant['reference']!r} was already used: nothing added; its grant:")
    return grant


async def create_key(args, changes: TenancyChanges) -> Any:
    secret, key = await changes.create_key({"org": args.org, "name": args.name, **body_of(args, *KEY_FIELDS)})
    if not args.json:
        print(f"secret: {secret}\n(shown this once: the store keeps only its SHA-256)")
    return {"key": secret, "data": key} if args.json else key


async def list_keys(args, changes: TenancyChanges) -> Any:
    return {"data": await changes.keys(args.org)}


async def show_key(args, changes: TenancyChanges) -> Any:
    return await changes.key(args.key_id)


async def update_key(args, changes: TenancyChanges) -> Any:
    return await changes.update_key(args.key_id, body_of(args, *KEY_FIELDS, "disabled"))


async def revoke_key(args, changes: TenancyChanges) -> Any:
    return await changes.revoke_key(args.key_id)


# -- running one ---------------------------------------------------------------------------------------

def run(args: argparse.Namespace, action: Callable) -> int:
    config = load_config(args.config) if args.config else _demo_store()
    out = asyncio.run(_run(config, args, action))
    print(json.dumps(out, indent=2) if args.json else render(out))
    return 0


async def _run(config, args: argparse.Namespace, action: Callable) -> Any:
    try:
        async with open_command_store(config) as store:
            books = Books(store.db, config.storage.replica_timeout_seconds)
            return await action(args, TenancyChanges(TenancyView(config, store, books), ACTOR))
    except GatewayError as exc:
        raise KilnError(_message(exc)) from None
    except Exception as exc:
        if not is_store_outage(exc):
            raise
        where = "PostgreSQL" if config.storage.url else f"the database {str(config.db_path)!r}"
        raise StorageError(f"cannot reach {where}: {reason(exc, config.storage.url or '')}") from None


def _demo_store() -> Any:
    """With no config, the store of the demo that ``python -m kilnproxy`` serves from this folder."""
    config = demo_config("http://127.0.0.1/v1", "127.0.0.1", 8080)  # the upstream is never reached here
    if not config.db_path.exists():
        raise KilnError(f"no config given and no demo store {str(config.db_path)!r} here: run the command "
                        "where the demo runs, or name a config: --config FILE (or set KILNPROXY_CONFIG)")
    return config


def _message(exc: GatewayError) -> str:
    """A refusal as one line, naming the command's option rather than the API's field."""
    if exc.status == 400 and exc.param:
        where = POSITIONAL.get(exc.param) or f"--{exc.param.replace('_', '-')}"
        return f"{where}: {exc.message}"
    return exc.message


POSITIONAL = {"id": "ID", "amount": "AMOUNT"}
