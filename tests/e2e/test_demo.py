"""The demo (no config) pointed at llama.cpp: the README's curl and SDK snippets work as written.

``python -m kilnproxy serve --upstream URL`` is the demo with a real model
server in place of the embedded mock. The snippets are read from README.md
and run as a user would (curl in a shell, the SDK in a fresh Python), with
only the demo's address changed to the free port it got.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

import orjson
import pytest

from kilnproxy.testing import usage_rows

from .stack import ROOT, GatewayProcess
from .support import events, frames

README = (ROOT / "README.md").read_text()
DEMO_URL = "http://127.0.0.1:8080"


def readme_block(lang: str, starts: str) -> str:
    match = re.search(rf"```{lang}\n({re.escape(starts)}.*?)```", README, re.S)
    assert match, f"README.md has no {lang} block starting with {starts!r}"
    return match.group(1)


@pytest.fixture(scope="module")
def demo(stack, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("demo")
    gateway = GatewayProcess(workdir, ["serve", "--upstream", f"{stack.llama_url}/v1", "--port", "0"],
                             name="kilnproxy-demo")
    try:
        yield gateway, workdir
    finally:
        gateway.stop(signal.SIGINT)  # no drain: the module is done


def test_banner_names_the_upstream_and_the_readme_curl(demo, stack):
    gateway, _ = demo
    banner = gateway.output()
    assert f"the model server at {stack.llama_url}/v1" in banner
    curl = readme_block("sh", "curl -N").strip()
    assert " ".join(curl.replace(DEMO_URL, gateway.url).split()) in " ".join(banner.split())


def test_readme_curl_streams_a_real_completion(demo):
    gateway, workdir = demo
    command = readme_block("sh", "curl -N").replace(DEMO_URL, gateway.url)
    out = subprocess.run(["bash", "-c", command], capture_output=True, timeout=60, check=True).stdout
    chunks = events(frames(out))
    assert chunks and all(c["model"] == "kiln-demo" and c.get("usage") is None for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks).strip()
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] in ("length", "stop")

    # the row of a request served alone reaches the table a moment after its response (the row journal)
    deadline = time.monotonic() + 10
    while not (rows := usage_rows(workdir / "kilnproxy.db")) and time.monotonic() < deadline:
        time.sleep(0.005)
    [r] = rows
    org, model, stream, status, completion, cost = (
        r["org"], r["model"], r["stream"], r["status"], r["completion_tokens"], r["cost"])
    assert (org, model, stream, status) == ("demo", "kiln-demo", 1, 200)
    assert 0 < completion <= 12 and cost > 0


def test_readme_sdk_snippet_prints_text_then_usage(demo):
    gateway, _ = demo
    code = readme_block("python", "from openai import OpenAI").replace(DEMO_URL, gateway.url)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    text, _, usage = out.stdout.rstrip("\n").rpartition("\n")
    assert text.strip()
    assert re.fullmatch(r"CompletionUsage\(completion_tokens=\d+, prompt_tokens=\d+, total_tokens=\d+, .*"
                        r"cost=[0-9.e-]+\)", usage), usage
    assert orjson.dumps(out.stderr) == b'""'


def test_upstream_is_for_the_demo_only(tmp_path):
    config = tmp_path / "k.toml"
    config.write_text('[[models]]\nid = "m"\nupstreams = ["http://127.0.0.1:9/v1"]\n')
    out = subprocess.run([sys.executable, "-m", "kilnproxy", "serve", "--config", str(config),
                          "--upstream", "http://127.0.0.1:9/v1"], capture_output=True, text=True, timeout=30)
    assert (out.returncode, out.stdout) == (2, "")
    assert out.stderr == ("kilnproxy: error: --upstream only applies to the demo; "
                          "set [[models]] upstreams in the config instead\n")
