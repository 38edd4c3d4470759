"""pytest fixtures for plugin authors, registered through the ``pytest11`` entry point.

``kilnproxy_harness(**options)`` builds a ``kilnproxy.testing.Harness`` (a real
gateway in front of the mock upstream) in the test's ``tmp_path``::

    async def test_redacts(kilnproxy_harness):
        async with kilnproxy_harness(plugins=["plugins/redact.py"]) as h:
            await h.openai().completions.create(model=h.model, prompt="mail a@b.io", max_tokens=2)
            assert (await h.mock_requests())[-1]["body"]["prompt"] == "mail [REDACTED]"

Each call gets its own folder (and usage database), so one test may start
several gateways.
"""

from __future__ import annotations

import itertools

import pytest

from .testing import Harness


@pytest.fixture
def kilnproxy_harness(tmp_path):
    """Build a ``Harness``: ``async with kilnproxy_harness(plugins=[...], settings={...}) as h``."""
    counter = itertools.count()

    def make(**options) -> Harness:
        folder = tmp_path / f"gateway-{next(counter)}"
        folder.mkdir()
        return Harness(folder, **options)

    return make
