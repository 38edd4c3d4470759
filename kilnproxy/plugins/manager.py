"""Building the plugin manager, and calling hooks by plugin so errors name it.

``build_plugin_manager(config)`` registers, in order: the built-in plugins
(``DEFAULT_PLUGINS``), the ``kilnproxy`` entry-point group (unless
``[plugins] entry_points = false``), the config's ``[plugins] modules`` (file
paths relative to the config, or dotted names), then any plugin objects the
caller passes; and finally checks every ``@hookimpl`` (a misspelled hook, an
unknown argument, an ``async`` ``transform_event`` or a hook wrapper fails
start-up with one line naming the plugin).

``Hooks`` looks the implementations of each hook up once. The request path
asks it ``hooks.transform_event`` (a tuple, empty when nobody implements the
hook, so the hot path skips it) and calls each ``Impl`` itself, so that an
exception can be pinned on the plugin that raised it.
"""

from __future__ import annotations

import asyncio
import difflib
import importlib
import importlib.metadata
import importlib.util
import inspect
import logging
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Iterable, Mapping

import orjson
import pluggy

from .. import hookspecs
from ..answers import header_fault
from ..config import Config
from ..errors import GatewayError, PluginError, plugin_failed

log = logging.getLogger("kilnproxy.plugins")

DEFAULT_PLUGINS = (
    "kilnproxy.plugins.builtin.upstream_body",
    "kilnproxy.plugins.builtin.pricing",
)
BUILT_IN = frozenset(module.rpartition(".")[2] for module in DEFAULT_PLUGINS)  # their plugin names

ENTRY_POINT_GROUP = "kilnproxy"
HOOK_NAMES = tuple(name for name, f in vars(hookspecs).items()
                   if callable(f) and hasattr(f, "kilnproxy_spec"))
SYNC_ONLY_HOOKS = ("transform_event",)  # per streamed event: never awaited


@dataclass(frozen=True)
class LoadedPlugin:
    name: str
    source: str  # "built-in", "entry point <dist> <version>", the config's path or module, or "passed in"
    hooks: tuple[str, ...]


def build_plugin_manager(config: Config, extra_plugins: Iterable[Any] = ()) -> pluggy.PluginManager:
    """The plugin manager of one gateway. ``extra_plugins``: objects with ``@hookimpl``
    methods, registered last under their ``__name__`` (or class name)."""
    pm = pluggy.PluginManager("kilnproxy")
    pm.add_hookspecs(hookspecs)
    pm.plugin_sources = {}  # plugin name -> where it came from, for `kilnproxy plugins`
    for dotted in DEFAULT_PLUGINS:
        _register(pm, importlib.import_module(dotted), dotted.rsplit(".", 1)[1], "built-in")
    if config.plugins.entry_points:
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            try:
                plugin = ep.load()
            except BaseException as exc:
                raise PluginError(ep.name, f"entry point {ep.value!r} failed to import: "
                                           f"{type(exc).__name__}: {exc}") from None
            dist = f"{ep.dist.name} {ep.dist.version}" if ep.dist else ep.value
            _register(pm, plugin, ep.name, f"entry point {dist}")
    for spec in config.plugins.modules:
        name, module = _import_config_module(config, spec)
        _register(pm, module, name, spec)
    for plugin in extra_plugins:
        name = getattr(plugin, "__name__", None) or type(plugin).__name__
        _register(pm, plugin, name.rsplit(".", 1)[-1], "passed in")
    _check_pending(pm)
    _check_impls(pm)
    return pm


def _register(pm: pluggy.PluginManager, plugin: Any, name: str, source: str) -> None:
    if pm.has_plugin(name):
        raise PluginError(name, f"a plugin of that name is already loaded (from {pm.plugin_sources[name]});"
                                " rename one of them")
    try:
        pm.register(plugin, name=name)
    except pluggy.PluginValidationError as exc:  # pluggy's message spans lines: one line, as every refusal
        raise PluginError(name, " ".join(str(exc).split())) from None
    except ValueError as exc:  # the same object registered twice
        raise PluginError(name, str(exc)) from None
    pm.plugin_sources[name] = source


def _check_pending(pm: pluggy.PluginManager) -> None:
    """pluggy's ``check_pending``, with a message that suggests the hook meant."""
    for name, caller in vars(pm.hook).items():
        if not isinstance(caller, pluggy.HookCaller) or caller.has_spec():
            continue
        for impl in caller.get_hookimpls():
            if not impl.optionalhook:
                near = difflib.get_close_matches(name, HOOK_NAMES, n=1)
                hint = f"did you mean {near[0]!r}?" if near else f"the hooks are {', '.join(HOOK_NAMES)}"
                raise PluginError(impl.plugin_name, f"@hookimpl {name!r} is not a kilnproxy hook; {hint}")


def _check_impls(pm: pluggy.PluginManager) -> None:
    for name in HOOK_NAMES:
        for impl in getattr(pm.hook, name).get_hookimpls():
            if impl.hookwrapper or impl.wrapper:
                raise PluginError(impl.plugin_name, f"{name}: hook wrappers are not supported;"
                                                    " use tryfirst=True or trylast=True to order hooks")
            if name in SYNC_ONLY_HOOKS and (inspect.iscoroutinefunction(impl.function)
                                            or inspect.isasyncgenfunction(impl.function)):
                raise PluginError(impl.plugin_name, f"{name} must be a plain function, not async def:"
                                                    " it runs once per streamed event")


def _import_config_module(config: Config, spec: str) -> tuple[str, ModuleType]:
    if spec.endswith(".py") or "/" in spec or "\\" in spec:
        path = config.resolve(spec)
        name = path.stem
        if not path.is_file():
            raise PluginError(name, f"[plugins] modules: file {str(path)!r} not found")
        module_name = f"kilnproxy_plugin_{name}"
        loader_spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[module_name] = module
        try:
            loader_spec.loader.exec_module(module)
        except BaseException as exc:
            sys.modules.pop(module_name, None)
            raise PluginError(name, f"{path} failed to import: {type(exc).__name__}: {exc}") from None
        return name, module
    name = spec.rsplit(".", 1)[-1]
    try:
        return name, importlib.import_module(spec)
    except BaseException as exc:
        raise PluginError(name, f"[plugins] modules: cannot import {spec!r}: {type(exc).__name__}: {exc}") from None


def loaded_plugins(pm: pluggy.PluginManager) -> list[LoadedPlugin]:
    """What is loaded, from where, and which hooks each implements, in registration order."""
    out = []
    for name, source in pm.plugin_sources.items():
        plugin = pm.get_plugin(name)
        implemented = {h.name for h in pm.get_hookcallers(plugin) or ()}
        hooks = tuple(h for h in HOOK_NAMES if h in implemented)  # in the order they run
        out.append(LoadedPlugin(name, source, hooks))
    return out


class Impl:
    """One plugin's implementation of one hook, callable with keyword arguments."""

    __slots__ = ("plugin", "hook", "function", "argnames")

    def __init__(self, plugin: str, hook: str, function: Callable, argnames: tuple[str, ...]):
        self.plugin = plugin
        self.hook = hook
        self.function = function
        self.argnames = argnames


class Hooks:
    """The implementations of every hook, in call order, looked up once.

    Each attribute is a tuple of ``Impl``; an empty tuple means no plugin
    implements the hook, and the request path then does not call it at all.
    """

    def __init__(self, pm: pluggy.PluginManager):
        self.pm = pm
        for name in HOOK_NAMES:
            impls = getattr(pm.hook, name).get_hookimpls()
            setattr(self, name, tuple(
                Impl(i.plugin_name, name, i.function, tuple(i.argnames)) for i in reversed(impls)
            ))

    startup: tuple[Impl, ...]
    shutdown: tuple[Impl, ...]
    check_request: tuple[Impl, ...]
    rewrite_request: tuple[Impl, ...]
    transform_event: tuple[Impl, ...]
    transform_response: tuple[Impl, ...]
    response_headers: tuple[Impl, ...]
    record_usage: tuple[Impl, ...]


def call_impl(impl: Impl, kwargs: dict[str, Any]) -> Any:
    return impl.function(**{a: kwargs[a] for a in impl.argnames})


async def call_maybe_async(impl: Impl, kwargs: dict[str, Any]) -> Any:
    result = call_impl(impl, kwargs)
    if inspect.isawaitable(result):
        result = await result
    return result


# -- the hooks that run once per request, before the response has started -----


def being_cancelled(exc: BaseException) -> bool:
    """``exc`` is the cancellation of the running task (the client went away, the gateway stops), which
    must propagate; not a ``CancelledError`` a plugin raised itself, nor any other exception."""
    if not isinstance(exc, asyncio.CancelledError):
        return False
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


async def call_pinned(impl: Impl, kwargs: dict[str, Any]) -> Any:
    """Call (and await) one implementation. A ``Refusal`` it raises answers the
    request; any other exception, ``BaseException`` included (``KeyboardInterrupt``,
    ``SystemExit``, a ``CancelledError`` of its own), becomes the request's 500
    ``plugin_error``. Only a real cancellation of the request's task propagates."""
    try:
        return await call_maybe_async(impl, kwargs)
    except GatewayError as refusal:
        raise _checked_refusal(impl, refusal) from None
    except BaseException as exc:
        if being_cancelled(exc):
            raise
        log.error("plugin %r raised in %s", impl.plugin, impl.hook, exc_info=exc)
        raise plugin_failed(impl.plugin, impl.hook, exc) from exc


async def run_request_hooks(hooks: Hooks, call: Any, body: dict) -> None:
    """``check_request`` (the first refusal answers the request), then ``rewrite_request``."""
    kwargs = {"call": call, "body": body}
    for impl in hooks.check_request:
        refusal = await call_pinned(impl, kwargs)
        if refusal is None:
            continue
        if isinstance(refusal, GatewayError):
            raise _checked_refusal(impl, refusal)
        raise _bad_return(impl, "None or a kilnproxy.Refusal", refusal)
    for impl in hooks.rewrite_request:
        await call_pinned(impl, kwargs)


async def plugin_headers(hooks: Hooks, call: Any) -> dict[str, str]:
    """The headers every ``response_headers`` implementation asks for, merged in call order."""
    out: dict[str, str] = {}
    for impl in hooks.response_headers:
        extra = await call_pinned(impl, {"call": call})
        if extra is None:
            continue
        if not isinstance(extra, Mapping) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in extra.items()):
            raise _bad_return(impl, "None or a dict of str to str", extra)
        _check_headers(impl, extra)
        out.update(extra)
    return out


async def transformed_response(hooks: Hooks, call: Any, body: dict,
                               dump: Callable[[Any], bytes] = orjson.dumps) -> bytes:
    """Run ``transform_response`` on ``body``; return it serialised by ``dump`` (which raises TypeError for
    what it cannot write)."""
    kwargs = {"call": call, "body": body}
    for impl in hooks.transform_response:
        await call_pinned(impl, kwargs)
    try:
        return dump(body)
    except TypeError as exc:
        names = ", ".join(i.plugin for i in hooks.transform_response)
        raise plugin_failed(names, "transform_response", TypeError(f"the body is no longer JSON: {exc}")) from exc


def _checked_refusal(impl: Impl, refusal: GatewayError) -> GatewayError:
    """``refusal`` when the gateway can send it: a status from 400 to 599 and headers
    ``header_fault`` accepts; else the plugin's ``plugin_error``."""
    status = refusal.status
    if type(status) is not int or not 400 <= status <= 599:
        return _may_not(impl, f"a Refusal's status must be an int from 400 to 599, not {status!r}")
    try:
        _check_headers(impl, refusal.headers)
    except GatewayError as exc:
        return exc
    return refusal


def _check_headers(impl: Impl, headers: Mapping) -> None:
    for name, value in headers.items():
        fault = header_fault(name, value)
        if fault is not None:
            raise _may_not(impl, fault)


def _may_not(impl: Impl, fault: str) -> GatewayError:
    exc = ValueError(f"returned something it may not: {fault}")
    log.error("plugin %r: %s %s", impl.plugin, impl.hook, exc)
    return plugin_failed(impl.plugin, impl.hook, exc)


def _bad_return(impl: Impl, expected: str, got: Any) -> GatewayError:
    exc = TypeError(f"returned {type(got).__name__}; expected {expected}")
    log.error("plugin %r: %s %s", impl.plugin, impl.hook, exc)
    return plugin_failed(impl.plugin, impl.hook, exc)
