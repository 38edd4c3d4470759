"""Building the plugin manager, and calling hooks by plugin so errors name it.

``build_plugin_manager(config)`` registers, in order: the built-in plugins
(``DEFAULT_PLUGINS``), the ``kilnproxy`` entry-point group, then the config's
``[plugins] modules`` (file paths relative to the config, or dotted names),
and finally checks that every ``@hookimpl`` names a real hook.

``Hooks`` looks the implementations of each hook up once. The request path
asks it ``hooks.transform_event`` (a tuple, empty when nobody implements the
hook) and calls each ``Impl`` itself, so that an exception can be pinned on
the plugin that raised it.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import inspect
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable

import pluggy

from . import hookspecs
from .config import Config
from .errors import PluginError

DEFAULT_PLUGINS = (
    "kilnproxy.default_plugins.upstream_body",
    "kilnproxy.default_plugins.pricing",
)

ENTRY_POINT_GROUP = "kilnproxy"


@dataclass(frozen=True)
class LoadedPlugin:
    name: str
    source: str  # "built-in", "entry point <dist>", or the path / module name from the config
    hooks: tuple[str, ...]


def build_plugin_manager(config: Config) -> pluggy.PluginManager:
    pm = pluggy.PluginManager("kilnproxy")
    pm.add_hookspecs(hookspecs)
    pm.plugin_sources = {}  # plugin name -> where it came from, for `kilnproxy plugins`
    for dotted in DEFAULT_PLUGINS:
        _register(pm, importlib.import_module(dotted), dotted.rsplit(".", 1)[1], "built-in")
    if config.plugins.entry_points:
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            if pm.has_plugin(ep.name):
                continue
            try:
                plugin = ep.load()
            except Exception as exc:
                raise PluginError(ep.name, f"entry point {ep.value!r} failed to import: {exc}") from None
            _register(pm, plugin, ep.name, f"entry point {ep.dist.name if ep.dist else ep.value}")
    for spec in config.plugins.modules:
        name, module = _import_config_module(config, spec)
        _register(pm, module, name, spec)
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        raise PluginError(getattr(exc.plugin, "__name__", str(exc.plugin)), str(exc)) from None
    return pm


def _register(pm: pluggy.PluginManager, plugin: Any, name: str, source: str) -> None:
    if pm.has_plugin(name):
        raise PluginError(name, f"a plugin of that name is already loaded (from {pm.plugin_sources[name]})")
    try:
        pm.register(plugin, name=name)
    except pluggy.PluginValidationError as exc:
        raise PluginError(name, str(exc)) from None
    pm.plugin_sources[name] = source


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
        except Exception as exc:
            sys.modules.pop(module_name, None)
            raise PluginError(name, f"{path} failed to import: {type(exc).__name__}: {exc}") from None
        return name, module
    name = spec.rsplit(".", 1)[-1]
    try:
        return name, importlib.import_module(spec)
    except Exception as exc:
        raise PluginError(name, f"[plugins] modules: cannot import {spec!r}: {type(exc).__name__}: {exc}") from None


def loaded_plugins(pm: pluggy.PluginManager) -> list[LoadedPlugin]:
    """What is loaded, from where, and which hooks each implements."""
    out = []
    for name, plugin in pm.list_name_plugin():
        hooks = tuple(sorted(h.name for h in pm.get_hookcallers(plugin) or ()))
        out.append(LoadedPlugin(name, pm.plugin_sources.get(name, "?"), hooks))
    return out


class Impl:
    """One plugin's implementation of one hook, callable with keyword arguments."""

    __slots__ = ("plugin", "hook", "function", "argnames", "is_async")

    def __init__(self, plugin: str, hook: str, function: Callable, argnames: tuple[str, ...]):
        self.plugin = plugin
        self.hook = hook
        self.function = function
        self.argnames = argnames
        self.is_async = inspect.iscoroutinefunction(function)


class Hooks:
    """The implementations of every hook, in call order, looked up once."""

    def __init__(self, pm: pluggy.PluginManager):
        self.pm = pm
        for name in ("startup", "shutdown", "check_request", "rewrite_request",
                     "transform_event", "transform_response", "response_headers", "record_usage"):
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
