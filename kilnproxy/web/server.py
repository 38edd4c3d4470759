"""Running servers: the gateway (and the demo's embedded mock) on real sockets.

``start_gateway`` is what both the CLI and the tests use, so tests run the
gateway exactly as users do: ``handler_cancellation`` on (a client that hangs
up cancels its handler, which closes the upstream request at once), no
aiohttp access log (the gateway writes its own usage rows), and aiohttp's
``auto_decompress`` off: request bodies reach the handlers as the client sent
them, and the gateway decodes them itself under its size limit
(``kilnproxy.proxy.request_body``). A request aiohttp cannot parse (a header line
without a colon, a line over 8 KiB, more than 128 headers, a Content-Length
that disagrees with Transfer-Encoding) never reaches a handler: it gets the
gateway's JSON 400 ``malformed_http`` (``kilnproxy.web.parser_errors``) and
is logged as one line, without the traceback aiohttp would log, so that
garbage from clients cannot flood the log.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import os
import signal
import socket
import struct
import sys
from dataclasses import dataclass, field
from typing import Callable

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from ..aiohttp_internals import site_sockets
from ..batches.install import LISTENING
from ..config import Config
from ..mock_servers.mock_upstream import create_mock_app
from .app import create_app
from .fastpath import HOT_ROUTES, FastRunner
from .parser_errors import answer_malformed_requests

log = logging.getLogger("kilnproxy")

# What is still running after the app's own grace period (kilnproxy.ops.lifecycle) is cancelled after this.
SHUTDOWN_SECONDS = 2.0
LINGER_POLL_SECONDS = 0.05  # how often linger() looks whether a connection is still open
HANDSHAKE_SECONDS = 0.1  # for a handshake under way to end (a round trip, in a data center well under this)


class _MalformedRequestsAsOneLine(logging.Filter):
    """aiohttp logs each request it cannot parse at ERROR level with a traceback: make it one INFO line."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            reason = str(exc.message).strip().splitlines()[0][:120] if exc.message else ""
            record.msg = "refused a malformed request from %s: %s %s"
            record.args = (record.args[0] if record.args else "?", exc.code, reason)
            record.exc_info = record.exc_text = None
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


HTTP_LOG = logging.getLogger("kilnproxy.http")
HTTP_LOG.addFilter(_MalformedRequestsAsOneLine())


@dataclass
class Running:
    runner: web.AppRunner
    host: str
    port: int
    _accepting: set[asyncio.Task] = field(default_factory=set)  # connections taken at a stop, being set up

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def app(self) -> web.Application:
        return self.runner.app

    async def stop(self) -> None:
        await self.runner.cleanup()

    async def stop_listening(self) -> None:
        """Close the listening sockets, holding new connections off them first (``HANDSHAKE_SECONDS``)
        and taking those waiting in their queues: no connection made is reset."""
        sites = list(self.runner.sites)
        if sum(hold_off_new_connections(listener) for site in sites for listener in _listeners(site)):
            await asyncio.sleep(HANDSHAKE_SECONDS)  # the handshakes under way end in the listeners' queues
        for site in sites:
            self._accept_waiting(site)
            await site.stop()  # (closes its listener before it first awaits: nothing is queued between the two)

    async def linger(self, seconds: float, hurry: asyncio.Event) -> None:
        """Once nothing listens: the connections still open are served for up to ``seconds`` more (or
        until ``hurry``), ending sooner once none is left. A balancer that kept an idle connection may
        send one more request on it: closing it now could cut that request."""
        server = self.runner.server
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while server is not None and server.connections and loop.time() < deadline and not hurry.is_set():
            await asyncio.sleep(LINGER_POLL_SECONDS)


    def _accept_waiting(self, site: web.BaseSite) -> None:
        """Accept the connections the kernel has completed on ``site``'s listener that the server has not
        taken yet, and serve them like the others. Closing a listener resets them, and a balancer may
        already have sent a request on one: it does not retry a POST that may have reached the server.
        """
        loop = asyncio.get_running_loop()
        for listener in _listeners(site):
            with socket.socket(fileno=os.dup(listener.fileno())) as waiting:  # the same queue, non-blocking
                while True:
                    try:
                        conn, _ = waiting.accept()
                    except OSError:  # BlockingIOError: none left
                        break
                    conn.setblocking(False)
                    if conn.family in (socket.AF_INET, socket.AF_INET6):
                        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    task = loop.create_task(loop.connect_accepted_socket(self.runner.server, conn))
                    self._accepting.add(task)
                    task.add_done_callback(self._accepting.discard)


def _listeners(site: web.BaseSite) -> list:
    """``site``'s listening TCP sockets (aiohttp gives no public way to them: ``site_sockets``)."""
    return [s for s in site_sockets(site) if s.type == socket.SOCK_STREAM]


# A classic BPF socket filter (Linux): a packet that opens a connection (SYN set) is dropped, any other
# kept. On a listener, new connections then get no answer, while the handshakes under way (their last
# packet carries no SYN) and the connections already made go on.
_DROP_SYN = ((0x30, 0, 0, 13),           # load the TCP header's flags byte
             (0x45, 0, 1, 0x02),         # SYN set: next instruction, else skip it
             (0x06, 0, 0, 0),            # drop
             (0x06, 0, 0, 0xFFFFFFFF))   # keep
_SO_ATTACH_FILTER = 26


def hold_off_new_connections(listener) -> bool:
    """From now on ``listener`` drops new connections' first packets (Linux; False elsewhere). Their
    clients send it again about a second later and find nothing listening then: a refusal, which a
    balancer retries on another server (nothing was sent), where closing the listener now would
    reset a connection whose handshake had just ended, its request perhaps sent."""
    if not sys.platform.startswith("linux"):
        return False
    program = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *step) for step in _DROP_SYN))
    try:
        with socket.socket(fileno=os.dup(listener.fileno())) as same:  # uvloop's own stands for it, with fewer methods
            same.setsockopt(socket.SOL_SOCKET, _SO_ATTACH_FILTER,
                            struct.pack("HP", len(_DROP_SYN), ctypes.addressof(program)))
    except OSError as exc:
        log.debug("could not hold new connections off the listener: %s", exc)
        return False
    return True


async def start_app(app: web.Application, host: str, port: int) -> Running:
    """A gateway app's hot endpoints (``HOT_ROUTES``) go to the server's own route table."""
    options = dict(handler_cancellation=True, access_log=None, shutdown_timeout=SHUTDOWN_SECONDS,
                   auto_decompress=False, logger=HTTP_LOG)
    if HOT_ROUTES in app:
        runner = FastRunner(app, app[HOT_ROUTES], **options)
    else:
        runner = web.AppRunner(app, **options)
    await runner.setup()
    answer_malformed_requests(runner.server)
    site = web.TCPSite(runner, host, port, backlog=4096, reuse_address=True)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    bound = runner.addresses[0][1] if port == 0 else port
    if LISTENING in app:
        app[LISTENING].tell(host, bound)  # the Batch API's runner sends its lines here
    return Running(runner, host, bound)


async def start_gateway(config: Config, host: str | None = None, port: int | None = None) -> Running:
    app = create_app(config)
    return await start_app(app, host or config.server.host, config.server.port if port is None else port)


async def start_mock(host: str = "127.0.0.1", port: int = 0, **options) -> Running:
    return await start_app(create_mock_app(**options), host, port)


async def wait_for_signal(ready: Callable[[], object] | None = None) -> None:
    """Return on SIGTERM or SIGINT. ``ready`` (e.g. printing "serving") runs once the handlers
    are in place, so a supervisor that signals as soon as it reads it gets a clean shutdown."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if ready is not None:
        ready()
    await stop.wait()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.remove_signal_handler(sig)


# Collections of the youngest generation: one per this many container objects allocated and not
# freed. At Python's 700, the objects of the requests in flight alone (64 of them: about 3,000)
# start a collection every few requests, which finds nothing to free and cost 9 µs a request.
YOUNG_THRESHOLD = 10_000


def settle_gc() -> None:
    """For a serving process, once it is set up: what start-up made moves out of the collector's
    sight (``gc.freeze``: config, routes, modules; the full collections that still run walk only
    what requests left behind), and young collections run per ``YOUNG_THRESHOLD`` allocations."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)


def run(main) -> None:
    """Run a coroutine function on uvloop when it is installed."""
    try:
        import uvloop
        loop_factory = uvloop.new_event_loop
    except ImportError:
        loop_factory = None
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(main())
