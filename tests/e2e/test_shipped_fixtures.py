"""The shipped llama.cpp recordings still describe the llama.cpp that ``make e2e`` runs.

``python -m kilnproxy replay FIXTURE --against URL`` for each of them, against
the live server: no difference in shape. A failure here means llama.cpp
changed how it answers: re-record with ``make fixtures`` and see what
tests/mock_servers/test_recorded_llamacpp.py says about the gateway.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from kilnproxy.testing import RECORDINGS

SHIPPED = sorted(p.name for p in (RECORDINGS / "llamacpp").glob("*.json"))


@pytest.mark.parametrize("name", SHIPPED)
async def test_replay_against_the_live_llama_finds_no_difference(stack, request, name):
    path = RECORDINGS / "llamacpp" / name
    # embeddings were recorded from the llama.cpp started with --embeddings
    url = request.getfixturevalue("embedder").url if name.startswith("embeddings") else stack.llama_url
    proc = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "kilnproxy", "replay", str(path),
                                                    "--against", f"{url}/v1"],
                                   capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[-1] == f"{path}: 0 difference(s) in shape against {url}/v1"
