"""kilnproxy.aiohttp_internals: each aiohttp internal it relies on still has the shape relied on, and no
other module of kilnproxy touches one.

When aiohttp moves, a test here fails with a sentence naming the internal that changed and the aiohttp
installed; the private names come from the module's own ``RELIED_ON``, so the two stay in step.
"""

from __future__ import annotations

import ast
import asyncio
import importlib
import inspect
from pathlib import Path

import aiohttp
import pytest
from packaging.specifiers import SpecifierSet
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from kilnproxy import aiohttp_internals
from kilnproxy.aiohttp_internals import ALSO_RELIED_ON, RELIED_ON, Internal

PACKAGE = Path(aiohttp_internals.__file__).parent
MODULE = Path(aiohttp_internals.__file__)
VERSION = aiohttp.__version__
PRIVATE = frozenset(i.name for i in RELIED_ON if i.name.startswith("_") and not i.name.startswith("__"))


def owner_name(owner: type) -> str:
    """``web.StreamResponse`` for a class aiohttp.web exports, else its module and name."""
    if getattr(web, owner.__name__, None) is owner:
        return f"web.{owner.__name__}"
    return f"{owner.__module__}.{owner.__qualname__}"


def what(internal: Internal) -> str:
    return f"{owner_name(internal.owner)}.{internal.name}"


def relied(internal: Internal) -> str:
    return f"which kilnproxy.aiohttp_internals relies on for {internal.use}"


def made(owner: type):
    """An instance of ``owner`` made by its own ``__init__``, with known arguments."""
    loop = asyncio.new_event_loop()
    try:
        if owner is web.StreamResponse:
            return web.StreamResponse(status=201, reason="Made")
        if owner is web.Application:
            return web.Application(client_max_size=12345)
        if owner is web.Server:
            return web.Server(lambda request: None, loop=loop, made_with=1)
        if owner is web.BaseRequest:
            return make_mocked_request("GET", "/", loop=loop)
    finally:
        loop.close()
    raise AssertionError(f"the test makes no {owner_name(owner)}: add it to made()")


def shape_fault(internal: Internal) -> str | None:
    """Why ``internal`` no longer has the shape relied on (None when it has)."""
    owner, name = internal.owner, internal.name
    head = f"aiohttp {VERSION}"
    if internal.shape == "default":
        if name not in dir(owner):
            return f"{head} no longer has {what(internal)} as a class-level default, {relied(internal)}"
        value = getattr(owner, name)
        if value != internal.default:
            return (f"{head}'s {what(internal)} defaults to {value!r}, not {internal.default!r}, "
                    f"{relied(internal)}")
    elif internal.shape == "init":
        instance = made(owner)
        if not hasattr(instance, name):
            return f"{head}'s {owner_name(owner)}.__init__ no longer sets {name}, {relied(internal)}"
    elif internal.shape == "slot":
        slots = {slot for klass in owner.__mro__ for slot in getattr(klass, "__slots__", ())}
        if name not in slots:
            return f"{head} no longer has {what(internal)} (a slot), {relied(internal)}"
    elif internal.shape == "method":
        method = getattr(owner, name, None)
        if not callable(method):
            return f"{head} no longer has the method {what(internal)}, {relied(internal)}"
        parameters = [p for p in inspect.signature(method).parameters.values() if p.name != "self"]
        names = tuple(p.name for p in parameters)
        if names[:len(internal.default)] != tuple(internal.default):
            return (f"{head}'s {what(internal)} takes {names}, not {tuple(internal.default)} first, "
                    f"{relied(internal)}")
        required = [p.name for p in parameters[len(internal.default):]
                    if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if required:
            return (f"{head}'s {what(internal)} now also requires {', '.join(required)}, "
                    f"{relied(internal)}")
    elif internal.shape == "attribute":
        if not hasattr(owner, name):
            return f"{head} no longer has {what(internal)}, {relied(internal)}"
    else:
        return (f"kilnproxy.aiohttp_internals names {what(internal)} with a shape the test does not know: "
                f"{internal.shape}")
    return None


@pytest.mark.parametrize("internal", RELIED_ON + ALSO_RELIED_ON, ids=what)
def test_each_internal_relied_on_still_has_its_shape(internal):
    fault = shape_fault(internal)
    assert fault is None, fault


def test_stream_response_init_sets_nothing_the_bare_responses_do_not():
    """The responses made without ``StreamResponse.__init__`` set what it sets (or override it); any
    other attribute must have a class-level default, or they would lack it."""
    set_by_them = {i.name for i in RELIED_ON if i.owner is web.StreamResponse and i.shape == "init"}
    instance = made(web.StreamResponse)
    new = sorted(name for name in vars(instance) if name not in set_by_them and name not in dir(web.StreamResponse))
    assert not new, (f"aiohttp {VERSION}'s web.StreamResponse.__init__ now sets {', '.join(new)} with no "
                     "class-level default, which kilnproxy.aiohttp_internals' OneWriteResponse and "
                     "DictHeadResponse (made without StreamResponse.__init__) would lack")
    assert (instance._status, instance._reason) == (201, "Made"), (
        f"aiohttp {VERSION}'s web.StreamResponse no longer keeps its status and reason in _status and "
        "_reason, which kilnproxy.aiohttp_internals' responses set for StreamResponse.status and set_status")


def test_what_the_init_attributes_hold():
    app, server = made(web.Application), made(web.Server)
    assert app._client_max_size == 12345, (
        f"aiohttp {VERSION}'s web.Application._client_max_size no longer holds client_max_size, which "
        "kilnproxy.aiohttp_internals.client_max_size reads for kilnproxy.web.fastpath's requests")
    assert server._kwargs == {"made_with": 1} and isinstance(server._loop, asyncio.AbstractEventLoop), (
        f"aiohttp {VERSION}'s web.Server no longer keeps its loop and handler arguments in _loop and _kwargs, "
        "which kilnproxy.aiohttp_internals.HandlerClassServer passes to its RequestHandler")
    swapped = made(web.Server)
    aiohttp_internals.use_server_class(swapped, type("Swapped", (aiohttp_internals.HandlerClassServer,), {}))
    assert isinstance(swapped, aiohttp_internals.HandlerClassServer)


def test_close_after_response_turns_keep_alive_off():
    request = made(web.BaseRequest)  # (keep_alive is computed once, when first read: not before this)
    assert not request._message.should_close
    aiohttp_internals.close_after_response(request)
    assert not request.keep_alive, (
        f"aiohttp {VERSION}'s web.BaseRequest.keep_alive no longer reads _message.should_close, which "
        "kilnproxy.aiohttp_internals.close_after_response sets for the shutdown's drain")


def test_the_installed_aiohttp_is_in_the_range_the_module_was_tested_for_and_setup_cfg_pins():
    pin = "aiohttp" + ",".join(aiohttp_internals.SUPPORTED)
    setup_cfg = (PACKAGE.parent / "setup.cfg").read_text(encoding="utf-8")
    assert f"\n    {pin}\n" in setup_cfg, f"setup.cfg does not pin {pin}, the range kilnproxy.aiohttp_internals names"
    assert SpecifierSet(",".join(aiohttp_internals.SUPPORTED)).contains(VERSION), (
        f"aiohttp {VERSION} is outside {pin}, the range kilnproxy.aiohttp_internals was written and tested for")


# -- no other module touches them ---------------------------------------------------------------------


def aiohttp_class(cls: object) -> bool:
    return isinstance(cls, type) and any((k.__module__ or "").startswith("aiohttp.") for k in cls.__mro__)


def aiohttp_privates(cls: type) -> frozenset[str]:
    """The private names of ``cls``'s aiohttp bases, and those ``RELIED_ON`` names (set by ``__init__``)."""
    names = {name for klass in cls.__mro__ if (klass.__module__ or "").startswith("aiohttp.")
             for name in (*vars(klass), *getattr(klass, "__slots__", ()))
             if name.startswith("_") and not name.startswith("__")}
    return frozenset(names | PRIVATE)


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")


def touches(path: Path) -> list[str]:
    """Where ``path`` touches an aiohttp private name: ``file:line: what``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    name = module_name(path)
    module = None
    if name != "kilnproxy.__main__" and any(isinstance(n, ast.ClassDef) or isinstance(n, ast.Assign)
                                            for n in ast.walk(tree)):
        module = importlib.import_module(name)
    where = str(path.relative_to(PACKAGE.parent))
    found = []

    def say(node: ast.AST, text: str) -> None:
        found.append(f"{where}:{node.lineno}: {text}")

    in_aiohttp_class: set[int] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef):
            continue
        cls = getattr(module, node.name, None) if module is not None else None
        if not aiohttp_class(cls):
            continue
        privates = aiohttp_privates(cls)
        for statement in node.body:
            names = []
            if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names = [statement.name]
            elif isinstance(statement, ast.Assign):
                names = [t.id for t in statement.targets if isinstance(t, ast.Name)]
            elif isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
                names = [statement.target.id]
            for defined in names:
                if defined in privates:
                    say(statement, f"{node.name} (a {owner_name(cls.__mro__[1])}) defines aiohttp's private {defined}")
        for inner in ast.walk(node):
            if (isinstance(inner, ast.Attribute) and isinstance(inner.value, ast.Name)
                    and inner.value.id == "self" and inner.attr in privates):
                in_aiohttp_class.add(id(inner))
                say(inner, f"{node.name} touches aiohttp's private self.{inner.attr}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in PRIVATE and id(node) not in in_aiohttp_class:
            if not (isinstance(node.value, ast.Name) and node.value.id == "self"):
                say(node, f"touches aiohttp's private {ast.unparse(node)}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("getattr", "setattr", "hasattr", "delattr"):
            for arg in node.args[1:2]:
                if isinstance(arg, ast.Constant) and arg.value in PRIVATE:
                    say(node, f"{node.func.id}(..., {arg.value!r}): aiohttp's private {arg.value}")
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Attribute) and target.attr == "__class__" \
                        and isinstance(node.value, ast.Name) and module is not None \
                        and aiohttp_class(getattr(module, node.value.id, None)):
                    say(node, f"swaps an object's class for {node.value.id}, an aiohttp class")
    return found


def test_no_other_module_touches_an_aiohttp_internal():
    found = [hit for path in sorted(PACKAGE.rglob("*.py")) if path != MODULE for hit in touches(path)]
    assert not found, ("these touch aiohttp's private names outside kilnproxy.aiohttp_internals (put the use "
                       "there, named in its RELIED_ON and docstring):\n" + "\n".join(found))


def test_the_scan_sees_the_uses_in_the_module_itself():
    """The scan would find them: run on kilnproxy.aiohttp_internals, it finds each private name it uses."""
    seen = " ".join(touches(MODULE))
    for name in PRIVATE:
        assert name in seen, f"the scan does not see kilnproxy.aiohttp_internals' own use of {name}"
