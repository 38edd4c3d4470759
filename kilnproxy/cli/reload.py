"""``python -m kilnproxy reload``: make a running gateway re-read its config.

``--pid N`` or ``--pidfile F`` (as written by ``serve --pidfile F``) sends the
process SIGHUP; the outcome is in the gateway's log. ``--url`` asks
``POST /admin/reload`` instead and reports the outcome here: exit 0 when the
new config is in force, 1 when it was refused (the running one stays).

A pid outside 1 .. ``PID_MAX`` and a URL that is not ``http(s)://host...`` are
refused before anything is sent: ``os.kill`` reads -1 as "every process" and
0 as "my process group", so neither may ever reach it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

from ..errors import KilnError

PID_MAX = 2**31 - 1


def add_reload_command(sub) -> None:
    p = sub.add_parser("reload", help="make a running gateway re-read its config (SIGHUP or POST /admin/reload)")
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--pid", type=int, help="process id of the gateway")
    target.add_argument("--pidfile", help="file holding the gateway's process id (serve --pidfile)")
    target.add_argument("--url", help="the gateway's base URL, e.g. http://127.0.0.1:8080")
    p.add_argument("--token", default=os.environ.get("KILNPROXY_ADMIN_TOKEN"),
                   help="[admin] token for --url (default: $KILNPROXY_ADMIN_TOKEN)")
    p.set_defaults(func=cmd_reload)


def cmd_reload(args: argparse.Namespace) -> int:
    if args.url:
        return _post_reload(_checked_url(args.url), args.token)
    pid = _checked_pid(args.pid, "--pid") if args.pid is not None else _read_pid(args.pidfile)
    try:
        os.kill(pid, signal.SIGHUP)
    except ProcessLookupError:
        raise KilnError(f"no process {pid} (is the gateway running?)") from None
    except PermissionError:
        raise KilnError(f"not allowed to signal process {pid}") from None
    print(f"sent SIGHUP to {pid}; the gateway's log tells whether the new config was taken")
    return 0


def _checked_pid(pid: int, source: str) -> int:
    """``pid`` if it names one process (1 .. PID_MAX); else a KilnError naming ``source``."""
    if not 1 <= pid <= PID_MAX:
        raise KilnError(f"{source}: {pid} is not a process id (1 to {PID_MAX})")
    return pid


def _read_pid(path: str) -> int:
    """The checked process id held by the pidfile at ``path``."""
    try:
        pid = int(Path(path).read_text().strip())
    except FileNotFoundError:
        raise KilnError(f"{path}: no such pidfile (start the gateway with serve --pidfile {path})") from None
    except (OSError, ValueError) as exc:
        raise KilnError(f"{path}: not a pidfile: {exc}") from None
    return _checked_pid(pid, path)


def _checked_url(url: str) -> str:
    """``url`` without a trailing slash if it is an http(s) URL with a host; else a KilnError."""
    try:
        parts = urlsplit(url)
        host, _port = parts.hostname, parts.port
    except ValueError as exc:
        raise KilnError(f"--url {url!r}: {exc}") from None
    if parts.scheme not in ("http", "https") or not host:
        raise KilnError(f"--url {url!r}: not an http(s) URL (e.g. http://127.0.0.1:8080)")
    return url.rstrip("/")


def _post_reload(url: str, token: str | None) -> int:
    request = urllib.request.Request(f"{url}/admin/reload", method="POST", data=b"")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            print(f"reloaded: {json.loads(resp.read())['summary']}")
            return 0
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = f"HTTP {exc.code}"
        if exc.code == 422:
            print(f"refused, the running config stays in force: {message}")
            return 1
        raise KilnError(f"{url}/admin/reload: {message}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise KilnError(f"cannot reach {url}: {getattr(exc, 'reason', exc)}") from None
