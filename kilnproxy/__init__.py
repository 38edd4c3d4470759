"""kilnproxy: a self-hostable LLM gateway. Plugins import what they need from here.

The package, in layers: each part imports only the parts below it (``setup.cfg`` [importlinter]).

* ``__main__``, ``pytest_plugin``: ``python -m kilnproxy``, and the ``kilnproxy_harness`` fixture;
* ``cli``, ``testing``: the commands; the ``Harness`` that starts a real gateway for tests;
* ``web``: the aiohttp app (the composition root) and its servers;
* ``ops``, ``inspector``: metrics, admin API, reload, drain, tracing; the inspector's UI and API, and the org
  admins' portal page;
* ``batches``: the Batch API (``/v1/files``, ``/v1/batches``) and the runner of batches' lines;
* ``proxy``: the request's path, from the client to the upstream and back, and its usage row;
* ``plugins``, ``store``, ``mock_servers``: the plugin manager and built-ins; the ledger (SQLite,
  PostgreSQL); the mock upstream, the recorder and the replay server;
* ``usage``: a request's token counts and cost;
* ``config``, ``config_ops``, ``config_env``, ``config_reader``: the config loaded and checked; the
  operator's tables; the keys from the environment (``KILNPROXY__<TABLE>__<KEY>``); one TOML table read
  with its names and types checked;
* the kernel, which imports nothing above it: ``access`` (operator access), ``call`` (``Call``, what a
  hook is handed), ``config_types``, ``errors``, ``hookspecs``, ``sse``, ``tasks``; below them ``answers``
  (a whole non-streamed answer in one write), and lowest ``aiohttp_internals`` (every use of aiohttp's
  private names, for the aiohttp versions it names).
"""

from .errors import GatewayError as Refusal
from .errors import KilnError
from .hookspecs import hookimpl
from .call import DROP, STOP, Call

__all__ = ["hookimpl", "Call", "Refusal", "STOP", "DROP", "KilnError"]
__version__ = "0.1.0"
