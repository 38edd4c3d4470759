"""Start a real gateway in front of the mock upstream, in a few lines: for tests.

Used by kilnproxy's own tests and by plugin authors::

    from kilnproxy.testing import Harness

    async def test_my_plugin(tmp_path):
        async with Harness(tmp_path, plugins=["plugins/my_plugin.py"],
                           settings={"my_plugin": {"level": 3}}) as h:
            client = h.openai()
            out = await client.completions.create(model=h.model, prompt="hi", max_tokens=3)
            assert (await h.rows())[0]["status"] == 200

With pytest, the ``kilnproxy_harness`` fixture (``kilnproxy.pytest_plugin``,
loaded automatically once kilnproxy is installed) saves the ``tmp_path``:
``async with kilnproxy_harness(plugins=[...]) as h``.

``plugins`` takes what ``[plugins] modules`` takes (file paths, relative to
``base_dir``, by default the current directory; dotted module names) and also
plugin objects: a module, a class or an instance with ``@hookimpl`` methods,
registered under its ``__name__`` (or class name). Entry-point plugins are
off unless ``entry_points=True``, so that what is installed in the
environment does not leak into a test.

Both servers listen on real loopback ports; ``h.url`` is the gateway,
``h.mock_url`` the mock. ``h.config`` is the TOML document as a dict (change
it with ``overrides``, merged one level deep, or ``configure``, a function
that edits the dict in place once the mock's URL is in it). ``h.rows()`` reads
the usage table as dicts (from PostgreSQL when ``[storage] url`` is set;
``usage_row(db, id)`` waits for one row in a gateway process's file),
``h.mock_requests()`` what the mock received (what ``rewrite_request``
left), ``h.usage_recorded()`` waits until every row so far has been through
the ``record_usage`` plugins, and ``h.gw`` is the running ``Gateway``.

Against a recorded real model server instead of the mock: ``replay=`` takes
a fixture file, a folder of them, a list, or ``Replay(*sources, timing=True)``
(docs/fixtures.md). The model's ``upstream_model`` becomes the fixtures'
model, so a request built with ``h.client_body()`` reaches the upstream with
the recorded body; ``h.fixtures`` are the loaded fixtures. ``Replay``,
``Recorder``, ``RECORDINGS`` (the recordings shipped with kilnproxy) and
``sse_frames`` / ``sse_events`` come from ``kilnproxy.testing.recordings``.

Its modules: ``harness`` (``Harness`` and the test config), ``postgres`` (a throw-away
PostgreSQL server in a temporary folder, from Debian's binaries), ``recordings`` (replay and record).

This package may import any part of kilnproxy; nothing in kilnproxy imports it
but ``kilnproxy.pytest_plugin``.
"""

from .harness import (
                      KEY,
                      MODEL,
                      OTHER_KEY,
                      UPSTREAM_MODEL,
                      Harness,
                      base_config,
                      completion_body,
                      free_port,
                      pg_usage_rows,
                      usage_row,
                      usage_rows,
)
from .recordings import RECORDINGS, Recorder, Replay, sse_events, sse_frames

__all__ = ["Harness", "KEY", "OTHER_KEY", "MODEL", "UPSTREAM_MODEL", "base_config", "usage_row", "usage_rows",
           "pg_usage_rows", "completion_body", "free_port", "RECORDINGS", "Recorder", "Replay", "sse_events", "sse_frames"]
