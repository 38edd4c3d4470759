"""Every hook is documented and tested; every example plugin is documented and tested
(as datasette's test_plugin_hooks_have_tests); hooks nobody implements cost nothing."""

import ast
import inspect
from pathlib import Path

import pytest

from kilnproxy import hookspecs
from kilnproxy.config import parse_config
from kilnproxy.plugins.manager import HOOK_NAMES, Hooks, build_plugin_manager

REPO = Path(__file__).resolve().parents[2]
TESTS = Path(__file__).parent


def functions_in(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}


def test_the_spec_hooks_keep_their_names_and_arguments():
    spec = {name: tuple(inspect.signature(getattr(hookspecs, name)).parameters) for name in HOOK_NAMES}
    assert spec["rewrite_request"] == ("call", "body")
    assert spec["transform_event"] == ("call", "event")
    assert spec["transform_response"] == ("call", "body")
    assert spec["record_usage"] == ("call", "usage")


@pytest.mark.parametrize("hook", HOOK_NAMES)
def test_hook_is_documented(hook):
    doc = inspect.getdoc(getattr(hookspecs, hook))
    assert doc and len(doc) > 200, f"{hook}: the docstring is the contract; say when, what, errors, cost"
    assert "Called" in doc, f"{hook}: say when it is called"
    assert "async def" in doc, f"{hook}: say whether it may be async"
    assert "Return" in doc, f"{hook}: say what its return value means"
    assert f"``{hook}``" in (REPO / "docs" / "plugins.md").read_text() or \
        f"### `{hook}" in (REPO / "docs" / "plugins.md").read_text(), f"{hook}: not in docs/plugins.md"


@pytest.mark.parametrize("hook", HOOK_NAMES)
def test_hook_has_tests(hook):
    assert f"test_hook_{hook}" in functions_in(TESTS / "test_hooks.py"), \
        f"tests/plugins/test_hooks.py needs test_hook_{hook}: what the hook promises"
    assert f"test_raising_in_{hook}" in functions_in(TESTS / "test_plugin_isolation.py"), \
        f"tests/plugins/test_plugin_isolation.py needs test_raising_in_{hook}: a plugin raising there fails one request"


@pytest.mark.parametrize("plugin", sorted(p.stem for p in (REPO / "plugins").glob("*.py")))
def test_example_plugin_is_documented_and_tested(plugin):
    source = (REPO / "plugins" / f"{plugin}.py").read_text()
    doc = ast.get_docstring(ast.parse(source))
    assert doc and f"[plugins.settings.{plugin}]" in doc and f'"plugins/{plugin}.py"' in doc, \
        f"plugins/{plugin}.py: the docstring says what it does, how to install it and its settings"
    assert (TESTS / f"test_plugin_{plugin}.py").is_file(), f"plugins/{plugin}.py needs tests/plugins/test_plugin_{plugin}.py"
    assert f"plugins/{plugin}.py" in (REPO / "docs" / "plugins.md").read_text()


def test_hooks_nobody_implements_are_empty_tuples():
    config = parse_config({"models": [{"id": "m", "upstreams": ["http://127.0.0.1:9/v1"]}],
                           "plugins": {"entry_points": False}}, source="<test>", base_dir=REPO)
    hooks = Hooks(build_plugin_manager(config))
    implemented = {name for name in HOOK_NAMES if getattr(hooks, name)}
    assert implemented == {"rewrite_request", "transform_response"}  # the built-ins
    assert hooks.transform_event == () and hooks.response_headers == () and hooks.record_usage == ()
