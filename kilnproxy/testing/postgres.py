"""A throw-away PostgreSQL server for the tests and the benchmark: a real server, no container.

::

    from kilnproxy.testing.postgres import PostgresServer

    with PostgresServer() as pg:                 # initdb + pg_ctl start, on a free 127.0.0.1 port
        url = pg.create_database("ledger_a")     # postgresql://kiln:kiln-secret@127.0.0.1:PORT/ledger_a
        ...
        pg.stop()                                # the data folder stays: start() brings it back
        pg.start()
    # __exit__ stopped the server and deleted its folder

The binaries come from ``pg_config --bindir`` (Debian's ``postgresql``
package; ``make postgres`` installs it). PostgreSQL refuses to run as root,
so when this process is root, initdb and pg_ctl run as the ``postgres`` user
(``runuser -u postgres --``) and the folder (``tempfile.mkdtemp()``, not a
0700 pytest folder below which that user could not reach) is chowned to it.

Authentication is real, as in production: the role ``kiln`` (LOGIN, CREATEDB,
password ``PASSWORD``) connects over TCP with scram-sha-256, so a wrong
password in a URL is refused; the superuser ``postgres`` connects without a
password over the unix socket in the folder, which is what ``psql()`` uses.

``fsync=False`` (the default) turns off fsync and full-page writes: a crash of
the *server process* (``stop("immediate")``, ``kill -9``) loses nothing
committed either way, only an operating-system crash would. The benchmark
passes ``fsync=True`` so that its figures are those of a durable set-up.

No server outlives its Python process: ``__exit__`` and ``remove()`` stop it,
and an ``atexit`` hook stops and deletes whatever is still running.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")
_live: set[PostgresServer] = set()


def _bindir() -> Path:
    """The folder of initdb and pg_ctl, or a RuntimeError saying how to get them."""
    try:
        out = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        raise RuntimeError(f"pg_config not found ({e}): install PostgreSQL (`make postgres`)") from None
    bindir = Path(out.stdout.strip())
    if not (bindir / "initdb").is_file():
        raise RuntimeError(f"no initdb in {bindir} (pg_config --bindir): "
                           "install the PostgreSQL server (`make postgres`)")
    return bindir


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _quote_ident(name: str) -> str:
    if not _IDENTIFIER.fullmatch(name):
        raise ValueError(f"not a plain SQL identifier: {name!r}")
    return f'"{name}"'


def _quote_literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


class PostgresServer:
    """A throw-away PostgreSQL server in a temporary folder: initdb + pg_ctl from `pg_config --bindir`,
    run as the `postgres` user (runuser -u postgres --) when this process is root."""

    PASSWORD = "kiln-secret"
    USER = "kiln"
    host = "127.0.0.1"

    def __init__(self, *, fsync: bool = False):
        self.fsync = fsync
        self.port = 0           # chosen on the first start, kept across restarts
        self.running = False
        self.folder: Path | None = None  # mkdtemp()'d on the first start
        self._bindir: Path | None = None
        self._as_postgres = os.geteuid() == 0

    # -- paths ---------------------------------------------------------------------------------

    @property
    def data(self) -> Path:
        return self._folder / "data"

    @property
    def log(self) -> Path:
        """The server's log (stderr of every start, appended)."""
        return self._folder / "server.log"

    @property
    def socket_dir(self) -> Path:
        return self._folder

    @property
    def _folder(self) -> Path:
        if self.folder is None:
            raise RuntimeError("the server has not been started")
        return self.folder

    # -- life cycle ----------------------------------------------------------------------------

    def start(self) -> None:
        """initdb on the first start, then ``pg_ctl -w start``; returns once connections are accepted.

        The first start picks a free port (again if another process takes it before the
        server binds it); later starts reuse that port. Raises RuntimeError with the tail
        of the server's log when the server does not come up.
        """
        if self.running:
            return
        first = self.folder is None
        if first:
            self._bindir = _bindir()
            self._init_folder()
        attempts = 5 if first else 1
        for attempt in range(attempts):
            if first:
                self.port = _free_port()
            size = self.log.stat().st_size if self.log.exists() else 0
            result = self._run([self._bin("pg_ctl"), "start", "-w", "-t", "60", "-D", str(self.data),
                                "-l", str(self.log), "-o", f"-p {self.port}"])
            if result.returncode == 0:
                break
            log = self._log_since(size)
            if "could not bind" in log and attempt + 1 < attempts:
                continue  # someone took the port between our probe and the server's bind
            raise RuntimeError(f"PostgreSQL did not start on port {self.port} "
                               f"(pg_ctl exit {result.returncode}): {result.stdout}{result.stderr}"
                               f"--- tail of {self.log} ---\n{self._tail(log)}")
        self.running = True
        if first:
            self.psql(f"CREATE ROLE {self.USER} LOGIN CREATEDB PASSWORD {_quote_literal(self.PASSWORD)};\n"
                      f"CREATE DATABASE kiln OWNER {self.USER};")

    def stop(self, mode: str = "fast") -> None:
        """``pg_ctl stop -m fast|immediate`` and wait until it is down; the data folder is kept.

        ``immediate`` is a crash as far as the database is concerned (no checkpoint;
        the next start replays the WAL), which is what a test of an outage wants.
        """
        if mode not in ("fast", "immediate", "smart"):
            raise ValueError(f"unknown stop mode {mode!r}")
        if not self.running:
            return
        result = self._run([self._bin("pg_ctl"), "stop", "-w", "-t", "60", "-m", mode, "-D", str(self.data)])
        if result.returncode != 0:
            raise RuntimeError(f"pg_ctl stop failed: {result.stdout}{result.stderr}")
        self.running = False

    def remove(self) -> None:
        """Stop the server (immediately: nothing in it is kept) and delete its folder."""
        try:
            self.stop("immediate")
        finally:
            _live.discard(self)
            if self.folder is not None:
                shutil.rmtree(self.folder, ignore_errors=True)
                self.folder = None

    def __enter__(self) -> PostgresServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    # -- for tests -----------------------------------------------------------------------------

    def url(self, database: str = "kiln", user: str = USER, password: str | None = PASSWORD) -> str:
        """``postgresql://kiln:kiln-secret@127.0.0.1:PORT/kiln`` (no password part for ``None``)."""
        auth = user if password is None else f"{user}:{password}"
        return f"postgresql://{auth}@{self.host}:{self.port}/{database}"

    def create_database(self, name: str) -> str:
        """``CREATE DATABASE name OWNER kiln`` (a plain identifier) and return its ``url()``."""
        self.psql(f"CREATE DATABASE {_quote_ident(name)} OWNER {self.USER};")
        return self.url(name)

    def drop_database(self, name: str) -> None:
        """``DROP DATABASE IF EXISTS name WITH (FORCE)``: its sessions are ended first."""
        self.psql(f"DROP DATABASE IF EXISTS {_quote_ident(name)} WITH (FORCE);")

    def terminate_connections(self, database: str, application_name: str | None = None) -> int:
        """End every session on ``database`` (only those of ``application_name`` if given), as a
        lost connection does; return how many. Returns once they are gone (5 s at most)."""
        where = f"datname = {_quote_literal(database)} AND pid <> pg_backend_pid()"
        if application_name is not None:
            where += f" AND application_name = {_quote_literal(application_name)}"
        out = self.psql(f"SELECT count(*) FILTER (WHERE pg_terminate_backend(pid, 5000)) "
                        f"FROM pg_stat_activity WHERE {where};")
        return int(out.strip())

    def psql(self, sql: str, database: str = "postgres") -> str:
        """Run ``sql`` as the superuser through the unix socket and return psql's stdout.

        Unaligned and without headers (``-A -t``): one row a line, columns split by ``|``.
        Stops at the first error and raises RuntimeError with psql's message.
        """
        if not self.running:
            raise RuntimeError("the server is not running")
        result = subprocess.run(
            [self._bin("psql"), "-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1",
             "-h", str(self.socket_dir), "-p", str(self.port), "-U", "postgres", "-d", database],
            input=sql, capture_output=True, text=True, cwd=self._folder)
        if result.returncode != 0:
            raise RuntimeError(f"psql failed ({result.returncode}): {result.stderr.strip()}")
        return result.stdout

    # -- internals -----------------------------------------------------------------------------

    def _bin(self, name: str) -> str:
        assert self._bindir is not None
        return str(self._bindir / name)

    def _run(self, argv: list[str]) -> subprocess.CompletedProcess:
        """Run a server binary, as the postgres user when we are root."""
        if self._as_postgres:
            argv = ["runuser", "-u", "postgres", "--", *argv]
        # cwd: the postgres user may not be allowed into ours
        return subprocess.run(argv, capture_output=True, text=True, cwd=self._folder,
                              stdin=subprocess.DEVNULL)

    def _init_folder(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="kilnproxy-pg-"))
        _live.add(self)  # from here on, atexit deletes the folder (and stops the server)
        try:
            if self._as_postgres:
                shutil.chown(self.folder, "postgres", "postgres")
            result = self._run([self._bin("initdb"), "-D", str(self.data), "-U", "postgres",
                                "-A", "trust", "-E", "UTF8", "--locale=C", "--no-sync",
                                "--no-instructions"])
            if result.returncode != 0:
                raise RuntimeError(f"initdb failed ({result.returncode}): {result.stdout}{result.stderr}")
            # Real authentication on TCP; the superuser only through the folder's socket.
            (self.data / "pg_hba.conf").write_text(
                "local all all trust\n"
                "host all all 127.0.0.1/32 scram-sha-256\n")
            settings = {
                "listen_addresses": "'127.0.0.1'",
                "unix_socket_directories": _quote_literal(str(self.socket_dir)),
                "password_encryption": "'scram-sha-256'",
                "logging_collector": "off",
                "max_connections": "200",
                "shared_buffers": "'64MB'",
            }
            if not self.fsync:
                settings.update(fsync="off", full_page_writes="off")
            with open(self.data / "postgresql.conf", "a") as conf:
                conf.write("\n# kilnproxy.testing.postgres\n")
                conf.writelines(f"{key} = {value}\n" for key, value in settings.items())
        except BaseException:
            self.remove()
            raise

    def _log_since(self, offset: int) -> str:
        try:
            with open(self.log, "rb") as f:
                f.seek(offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    @staticmethod
    def _tail(text: str, lines: int = 30) -> str:
        return "\n".join(text.splitlines()[-lines:])


@atexit.register
def _remove_leftovers() -> None:
    for server in list(_live):
        try:
            server.remove()
        except Exception:  # the last resort: try the others
            pass
