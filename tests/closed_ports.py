"""Ports where nothing listens, for as long as the test run lasts: ``refused_port()`` binds a loopback port
and keeps it bound without listening, so a connection to it is refused (as to a port nobody uses) and no
other server, of this run or of a parallel one (pytest-xdist's workers), can take it meanwhile. For a dead
upstream or database; ``kilnproxy.testing.free_port`` is for a port a process is about to listen on."""

import atexit
import socket

_held: list[socket.socket] = []


def refused_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))  # bound, never listening: connections get a reset (ECONNREFUSED)
    _held.append(s)
    return s.getsockname()[1]


@atexit.register
def _close() -> None:
    for s in _held:
        s.close()
