"""The gateways users pick instead, installed on demand and started like kilnproxy (one core).

- Portkey AI Gateway (Node.js, npm ``@portkey-ai/gateway``), with ``@hono/node-server``
  pinned to 2.1.9 by an npm override (with the 1.x npm picks, every streamed request fails
  with ``TypeError: immutable``). It listens on every interface by itself; a preload
  (``peers/loopback.mjs``) makes it bind 127.0.0.1. It routes by headers:
  ``x-portkey-provider: openai`` and ``x-portkey-custom-host: <upstream base URL>``.
- LiteLLM proxy (pip ``litellm[proxy]``, in a virtualenv of its own), DB-less, one worker,
  one model entry per bench model name; a master key made up per run (it refuses to start
  without one), sent by the bench's clients as their bearer.

Each is optional: when it cannot be installed (no node/npm, no network), ``install_*``
prints one line saying so and returns ``None``, and the bench goes on without it.
Installs are kept in ``bench/.peers/`` for the next run.
"""

from __future__ import annotations

import json
import secrets
import shutil
import subprocess
import sys
import venv
from pathlib import Path

HERE = Path(__file__).resolve().parent
CACHE = HERE / ".peers"
PORTKEY = "Portkey"
LITELLM = "LiteLLM"
PORTKEY_PACKAGE = {"name": "kilnproxy-bench-portkey", "private": True,
                   "dependencies": {"@portkey-ai/gateway": "^1.15.2"},
                   "overrides": {"@hono/node-server": "2.1.9"}}
LITELLM_REQUIREMENT = "litellm[proxy]>=1.70"


def _skip(name: str, why: str) -> None:
    print(f"{name}: skipped, {why}", flush=True)


def install_portkey() -> list[str] | None:
    """argv (without ``--port=``) of the Portkey gateway, or None when it cannot be installed."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if not node or not npm:
        _skip(PORTKEY, "node and npm are not installed")
        return None
    folder = CACHE / "portkey"
    folder.mkdir(parents=True, exist_ok=True)
    manifest = folder / "package.json"
    wanted = json.dumps(PORTKEY_PACKAGE, indent=2)
    entry = folder / "node_modules" / "@portkey-ai" / "gateway" / "build" / "start-server.js"
    if not entry.exists() or manifest.read_text() != wanted:
        manifest.write_text(wanted)
        print(f"{PORTKEY}: npm install in {folder} ...", flush=True)
        out = subprocess.run([npm, "install", "--no-audit", "--no-fund", "--loglevel=error"], cwd=folder,
                             capture_output=True, text=True, timeout=600)
        if out.returncode != 0 or not entry.exists():
            _skip(PORTKEY, f"npm install failed: {(out.stderr or out.stdout).strip()[-300:]}")
            return None
    return [node, "--import", (HERE / "peers" / "loopback.mjs").as_uri(), str(entry), "--headless"]


def portkey_headers(upstream_base: str) -> dict[str, str]:
    return {"x-portkey-provider": "openai", "x-portkey-custom-host": upstream_base}


def litellm_headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {LITELLM_KEY}"}


def install_litellm() -> list[str] | None:
    """argv of the LiteLLM proxy (without ``--config``/``--port``), or None when it cannot be installed."""
    folder = CACHE / "litellm"
    exe = folder / "bin" / "litellm"
    if not exe.exists():
        print(f"{LITELLM}: pip install {LITELLM_REQUIREMENT} into {folder} ...", flush=True)
        try:
            venv.create(folder, with_pip=True)
        except (OSError, subprocess.CalledProcessError) as exc:
            _skip(LITELLM, f"cannot create a virtualenv: {exc}")
            return None
        out = subprocess.run([str(folder / "bin" / "python"), "-m", "pip", "install", "--quiet",
                              LITELLM_REQUIREMENT], capture_output=True, text=True, timeout=900)
        if out.returncode != 0 or not exe.exists():
            _skip(LITELLM, f"pip install failed: {(out.stderr or out.stdout).strip()[-300:]}")
            shutil.rmtree(folder, ignore_errors=True)
            return None
    return [str(exe), "--host", "127.0.0.1", "--num_workers", "1"]


def litellm_config(path: Path, models: dict[str, str], upstream_model: str) -> Path:
    """DB-less: no database, no master key; ``models``: bench model name -> upstream base URL."""
    lines = ["model_list:"]
    for name, base in models.items():
        lines += [f"  - model_name: {name}", "    litellm_params:", f"      model: openai/{upstream_model}",
                  f"      api_base: {base}", "      api_key: none"]
    lines += ["litellm_settings:", "  drop_params: true", "  telemetry: false"]
    path.write_text("\n".join(lines) + "\n")
    return path


# LiteLLM refuses to start without a strong master key; the bench's clients send it as their bearer.
LITELLM_KEY = "sk-" + secrets.token_hex(32)
LITELLM_ENV = {"LITELLM_MASTER_KEY": LITELLM_KEY,
               "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # no download of the price list at start-up
               "LITELLM_LOG": "ERROR", "LITELLM_MODE": "PRODUCTION", "NO_DOCS": "True",
               "DISABLE_SCHEMA_UPDATE": "True"}


def version(name: str) -> str:
    """The installed version of a peer, for the results file."""
    try:
        if name == PORTKEY:
            modules = CACHE / "portkey" / "node_modules"
            gateway = json.loads((modules / "@portkey-ai" / "gateway" / "package.json").read_text())["version"]
            hono = json.loads((modules / "@hono" / "node-server" / "package.json").read_text())["version"]
            return f"{gateway} (@hono/node-server {hono})"
        info = next((CACHE / "litellm").glob("lib/python*/site-packages/litellm-*.dist-info"))
        return info.name.removesuffix(".dist-info").split("-", 1)[1]
    except (OSError, StopIteration, KeyError, ValueError):
        return "?"


if __name__ == "__main__":  # install both: python bench/peers.py
    sys.exit(0 if install_portkey() and install_litellm() else 1)
