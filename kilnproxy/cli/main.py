"""``python -m kilnproxy`` (or the ``kilnproxy`` console script): the gateway and its sub-commands.

A ``KilnError`` is printed as one line (``kilnproxy: error: ...``) with exit
status 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from ..config import Config, load_config
from ..errors import KilnError

COMMANDS = ("serve", "mock-upstream", "usage", "plugins", "check-config", "reload", "import-ledger", "record",
            "replay", "orgs", "keys")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS and argv[0] not in ("-h", "--help"):
        argv.insert(0, "serve")
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args) or 0
    except KilnError as exc:
        print(f"kilnproxy: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # whoever read the output left (``| head``): nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush must not fail again
        return 1


def parser() -> argparse.ArgumentParser:
    prog = "kilnproxy" if Path(sys.argv[0]).name == "kilnproxy" else "python -m kilnproxy"  # console script or -m
    p = argparse.ArgumentParser(prog=prog, description="A self-hostable LLM gateway.")
    sub = p.add_subparsers(dest="command")

    serve = sub.add_parser("serve", help="serve the gateway (the default; the demo when no config is given)")
    _config_arg(serve)
    serve.add_argument("--host", help="override [server] host")
    serve.add_argument("--port", type=int, help="override [server] port")
    serve.add_argument("--pidfile", help="write the process id here (for `reload --pidfile`)")
    serve.add_argument("--upstream", metavar="URL",
                       help="demo only: serve the models of this OpenAI-compatible base URL (its /v1/models, "
                            "e.g. a llama.cpp server's http://127.0.0.1:8000/v1), and kiln-demo for the first, "
                            "instead of the embedded mock")
    serve.set_defaults(func=cmd_serve)

    mock = sub.add_parser("mock-upstream", help="run the fake vLLM-like model server")
    mock.add_argument("--host", default="127.0.0.1")
    mock.add_argument("--port", type=int, default=8000)
    mock.add_argument("--delay", type=float, default=0.0, help="seconds between streamed chunks")
    mock.add_argument("--context-window", type=int, default=4096)
    mock.add_argument("--flavor", choices=("vllm", "vllm_old", "llamacpp", "ollama"), default="vllm")
    mock.add_argument("--enable-prompt-tokens-details", action="store_true",
                      help="report usage.prompt_tokens_details.cached_tokens, as vLLM does with this flag")
    mock.add_argument("--served-model-name", action="append", default=[], metavar="NAME",
                      help="a model name to serve (repeat for several; vLLM's flag): /v1/models lists them and "
                           "another name gets vLLM's 404. Default: any name")
    mock.add_argument("--prompt-cache-slots", type=int, default=0, metavar="N",
                      help="model a server's prompt cache: N slots, each keeping its last prompt, reused by the "
                           "next prompt that begins the same way (reported as cached_tokens and on /metrics); "
                           "requests wait while all N are busy. Default 0: no cache")
    mock.add_argument("--prefill-seconds-per-token", type=float, default=0.0, metavar="SECONDS",
                      help="with --prompt-cache-slots: the time each prompt token not in the cache takes "
                           "before the answer starts. Default 0")
    mock.set_defaults(func=cmd_mock)
    from .fixtures import add_fixture_commands, add_replay_options
    add_replay_options(mock)
    add_fixture_commands(sub)

    from .usage import add_usage_command
    add_usage_command(sub, _config_arg)

    from .tenancy import add_tenancy_commands
    add_tenancy_commands(sub, _config_arg)

    plugins = sub.add_parser("plugins", help="list the loaded plugins and the hooks each implements")
    _config_arg(plugins)
    plugins.set_defaults(func=cmd_plugins)

    check = sub.add_parser("check-config", help="validate a config and print what it would serve")
    check.add_argument("file", nargs="?", default=os.environ.get("KILNPROXY_CONFIG"),
                       help="TOML config file (default: $KILNPROXY_CONFIG; none: the KILNPROXY__<TABLE>__<KEY> "
                            "variables alone)")
    check.add_argument("--settings", action="store_true",
                       help="print every setting outside [[models]], [[orgs]] and [[keys]] with where it came "
                            "from (file, environment, default); without it, those from the environment")
    check.set_defaults(func=cmd_check_config)

    from .reload import add_reload_command
    add_reload_command(sub)

    from .import_ledger import add_import_command
    add_import_command(sub)
    return p


def _config_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=os.environ.get("KILNPROXY_CONFIG"),
                   help="TOML config file (default: $KILNPROXY_CONFIG; none: the demo)")


def load_or_none(path: str | None) -> Config | None:
    return load_config(path) if path else None


def check_port(option: str, port: int | None) -> None:
    """Refuses a port outside 0-65535, as the config's ``port`` is (a socket would take 99999 mod 65536)."""
    if port is not None and not 0 <= port <= 65535:
        raise KilnError(f"{option}: must be between 0 and 65535, got {port}")


def cmd_serve(args) -> int:
    from ..web import server
    config = load_or_none(args.config)
    check_port("--port", args.port)
    if config is not None and args.upstream:
        raise KilnError("--upstream only applies to the demo; set [[models]] upstreams in the config instead")
    if args.pidfile:
        Path(args.pidfile).write_text(f"{os.getpid()}\n")
    try:
        server.run(lambda: _serve(config, args.host, args.port, args.upstream))
    finally:
        if args.pidfile:
            Path(args.pidfile).unlink(missing_ok=True)
    return 0


async def _serve(config: Config | None, host: str | None, port: int | None, upstream: str | None = None) -> None:
    from ..web import server
    from .demo import banner, demo_config
    mock = None
    demo = config is None
    if demo:
        if upstream is None:
            mock = await server.start_mock()
        config = demo_config(upstream or f"{mock.url}/v1", host or "127.0.0.1", 8080 if port is None else port,
                             discover=upstream is not None)
    try:
        gateway = await server.start_gateway(config, host, port)
    except BaseException as exc:
        if mock is not None:
            await mock.stop()
        if isinstance(exc, OSError):
            where = f"{host or config.server.host}:{config.server.port if port is None else port}"
            raise KilnError(f"cannot listen on {where}: {exc.strerror or exc}") from None
        raise
    server.settle_gc()
    from ..proxy.gateway import GATEWAY
    text = (banner(gateway.url, upstream, list(gateway.app[GATEWAY].routes)) if demo else
            f"kilnproxy serving {len(config.models)} model(s) on {gateway.url} (config {config.source})")
    from ..ops.admin import RELOADER, SHUTDOWN
    from ..ops.lifecycle import serve_until_stopped
    try:
        await serve_until_stopped(gateway, gateway.app[SHUTDOWN], gateway.app[RELOADER].on_signal,
                                  ready=lambda: print(text, flush=True))
    finally:
        if mock is not None:
            await mock.stop()
    not_committed = gateway.app[GATEWAY].ledger.not_committed
    if not_committed:  # the SQLite file could not be written up to the end: the rows are in the log
        raise KilnError(f"stopped with usage rows not committed to the ledger: {len(not_committed)}; each is in "
                        "the log above, on a line 'usage row not committed: ' and the row as JSON")


def cmd_mock(args) -> int:
    from ..web import server
    if args.replay:
        from .fixtures import serve_replay
        return serve_replay(args)
    if args.timing:
        raise KilnError("--timing only applies with --replay DIR")
    if args.prompt_cache_slots < 0 or args.prefill_seconds_per_token < 0:
        raise KilnError("--prompt-cache-slots and --prefill-seconds-per-token must be 0 or more")
    if args.prefill_seconds_per_token and not args.prompt_cache_slots:
        raise KilnError("--prefill-seconds-per-token only applies with --prompt-cache-slots N")

    async def main() -> None:
        running = await server.start_mock(args.host, args.port, delay=args.delay,
                                          context_window=args.context_window, flavor=args.flavor,
                                          prompt_tokens_details=args.enable_prompt_tokens_details,
                                          served_models=tuple(args.served_model_name),
                                          prompt_cache_slots=args.prompt_cache_slots,
                                          prefill_per_token=args.prefill_seconds_per_token)
        try:
            await server.wait_for_signal(lambda: print(f"mock upstream ({args.flavor}) on {running.url}/v1",
                                                       flush=True))
        finally:
            await running.stop()

    server.run(main)
    return 0


def cmd_plugins(args) -> int:
    from ..plugins.manager import build_plugin_manager, loaded_plugins
    from .demo import demo_config
    config = load_or_none(args.config) or demo_config("http://127.0.0.1:1/v1", "127.0.0.1", 8080)
    for plugin in loaded_plugins(build_plugin_manager(config)):
        print(f"{plugin.name}  ({plugin.source})\n    hooks: {', '.join(plugin.hooks) or '-'}")
    return 0


def _upstreams_text(model, given: dict[str, int]) -> str:
    """A model's upstreams, each capped one with its ``max_in_flight`` and ``batch_reserve`` (``given`` by a
    model, else the default), the URL's."""
    from ..config_types import default_batch_reserve
    return ", ".join(url if (limit := model.max_in_flight_of(i)) is None else
                     f"{url} (max_in_flight {limit}, batch_reserve {given.get(url, default_batch_reserve(limit))})"
                     for i, url in enumerate(model.upstreams))


def cmd_check_config(args) -> int:
    from ..plugins.manager import build_plugin_manager
    config = load_config(args.file)
    build_plugin_manager(config)
    if config.storage.url is None and config.db_path.exists():  # a check makes no file: start-up makes it
        from ..store.sqlite.schema import check_writable
        check_writable(config.db_path)
    print(f"{args.file or config.source}: OK")
    print(f"  listen   {config.server.host}:{config.server.port}")
    if config.storage.url:
        from ..store.postgres.connection import redacted
        print(f"  storage  {redacted(config.storage.url)} (spool {config.spool_path})")
    else:
        print(f"  storage  {config.db_path}")
    reserves = {u: r for m in config.models for i, u in enumerate(m.upstreams)
                if (r := m.batch_reserve_given(i)) is not None}
    for m in config.models:
        if m.discover:
            alias = f" (and {m.alias} for the first)" if m.alias else ""
            print(f"  models   {m.id}<each model listed>{alias}, discovered via {', '.join(m.upstreams)},"
                  f" routing {m.routing}")
        else:
            print(f"  model    {m.id} -> {m.upstream_model} via {_upstreams_text(m, reserves)}, routing {m.routing}")
    for o in config.orgs:
        keys = sum(1 for k in config.keys if k.org == o.id)
        admins = sum(1 for k in config.keys if k.org == o.id and k.role == "admin")
        print(f"  org      {o.id}: {o.credits} USD, {o.max_in_flight or config.limits.max_in_flight_per_org}"
              f" in flight, {o.priority}, weight {o.weight:g}, {keys} key(s)" + (f" ({admins} admin)" if admins else ""))
    print(f"  ops      metrics {'on' if config.metrics.enabled else 'off'}, access log "
          f"{'on' if config.log.access else 'off'}{' with bodies' if config.log.bodies else ''}, health checks "
          + (f"every {config.health.interval:g} s on {config.health.path}" if config.health.interval else "off")
          + ", admin " + (" or ".join(filter(None, ("token" if config.admin.token_sha256 else "",
                                                    "loopback" if config.admin.allow_loopback else "")))
                          or "nobody")
          + f", drain {config.server.drain_seconds:g} s, shutdown grace {config.server.shutdown_grace_seconds:g} s")
    if config.maintenance.enabled:
        print(f"  maintenance on (Retry-After: {config.maintenance.retry_after})")
    from .settings_text import setting_lines
    for line in setting_lines(config, args.settings):
        print(line)
    return 0
