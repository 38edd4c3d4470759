"""pytest fixtures for plugin authors, registered through the ``pytest11`` entry point.

``kilnproxy_harness(**options)`` builds a ``kilnproxy.testing.Harness`` (a real
gateway in front of the mock upstream) in the test's ``tmp_path``::

    async def test_redacts(kilnproxy_harness):
        async with kilnproxy_harness(plugins=["plugins/redact.py"]) as h:
            await h.openai().completions.create(model=h.model, prompt="mail a@b.io", max_tokens=2)
            assert (await h.mock_requests())[-1]["body"]["prompt"] == "mail [REDACTED]"

Each call gets its own folder (and usage database), so one test may start
several gateways. ``replay=`` puts a recorded real model server in place of
the mock (docs/fixtures.md).

``kilnproxy_recorder(upstream_url)`` records while a suite runs against a real
server: an ``async with`` gives a recording pass-through (``rec.url``) whose
fixtures go to the test's ``tmp_path / "recorded"``, or to the folder given
with ``pytest --kilnproxy-record DIR``.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from .testing import Harness, Recorder


def pytest_addoption(parser):
    parser.addoption("--kilnproxy-record", metavar="DIR", default=None,
                     help="kilnproxy_recorder writes its fixtures to DIR (default: each test's tmp_path)")


@pytest.fixture
def kilnproxy_harness(tmp_path):
    """Build a ``Harness``: ``async with kilnproxy_harness(plugins=[...], settings={...}) as h``."""
    counter = itertools.count()

    def make(**options) -> Harness:
        folder = tmp_path / f"gateway-{next(counter)}"
        folder.mkdir()
        return Harness(folder, **options)

    return make


@pytest.fixture
def kilnproxy_recorder(request, tmp_path):
    """Build a ``Recorder``: ``async with kilnproxy_recorder("http://127.0.0.1:8000/v1") as rec``."""
    chosen = request.config.getoption("--kilnproxy-record")
    out = Path(chosen).resolve() if chosen else tmp_path / "recorded"
    return lambda upstream, **options: Recorder(upstream, out, **options)
