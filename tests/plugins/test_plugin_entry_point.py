"""A plugin installed only through the ``kilnproxy`` entry-point group (tests/entrypoint_plugin,
installed by ``make install``) is loaded, listed, and can be turned off."""

import importlib.metadata

from kilnproxy.plugins.manager import loaded_plugins


def test_the_test_plugin_is_installed_as_a_distribution():
    [ep] = [ep for ep in importlib.metadata.entry_points(group="kilnproxy") if ep.name == "hello"]
    assert (ep.value, ep.dist.name) == ("kilnproxy_hello", "kilnproxy-hello")


async def test_loaded_through_its_entry_point(harness):
    async with harness(entry_points=True, settings={"hello": {"greeting": "bonjour"}}) as h:
        listed = {p.name: p for p in loaded_plugins(h.gw.pm)}
        assert (listed["hello"].source, listed["hello"].hooks) == ("entry point kilnproxy-hello 0.1.0",
                                                                   ("response_headers",))
        answer = await h.openai().completions.with_raw_response.create(model=h.model, prompt="Hi", max_tokens=2)
        assert answer.headers["X-Hello"] == "bonjour"


async def test_off_when_entry_points_are_off(harness):
    async with harness(settings={"hello": {"greeting": "bonjour"}}) as h:  # the Harness default
        assert "hello" not in {p.name for p in loaded_plugins(h.gw.pm)}
        answer = await h.openai().completions.with_raw_response.create(model=h.model, prompt="Hi", max_tokens=2)
        assert "X-Hello" not in answer.headers
