"""The container image (Containerfile; `make image` builds it, `make e2e` runs this): the demo served from a
container, the README's curl answered, the SQLite rows kept on the /data volume across containers, the drain
on `podman stop` under load with no failed request, a user that is not root, the gateway as PID 1.

How podman runs on these machines, and only here (none of it is in the image): `--runtime runc` (crun
refuses their cgroups) and a containers.conf, named by CONTAINERS_CONF, without default rlimits."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import time
import uuid

import aiohttp
import pytest

IMAGE = os.environ.get("KILNPROXY_IMAGE", "localhost/kilnproxy:latest")
BANNER = re.compile(r"kilnproxy (?:demo on|serving .* on) (http://\S+)")
README_CURL_BODY = '{"model": "kiln-demo", "prompt": "The capital of France is", "max_tokens": 12, "stream": true}'
DEMO_TEXT = " Paris is the capital of France and a city on the Seine."
RUN_AS = "10001"


@pytest.fixture(scope="module")
def podman_env(tmp_path_factory) -> dict[str, str]:
    conf = tmp_path_factory.mktemp("podman") / "containers.conf"
    conf.write_text("[containers]\ndefault_ulimits = []\n")
    env = {**os.environ, "CONTAINERS_CONF": str(conf)}
    found = subprocess.run(["podman", "image", "exists", IMAGE], env=env)
    assert found.returncode == 0, f"no image {IMAGE}: `make image` builds it (`make e2e` does first)"
    return env


class Podman:
    """``podman --runtime runc``, with the containers and volumes a test made removed at its end."""

    def __init__(self, env: dict[str, str]):
        self.env = env
        self.containers: list[str] = []
        self.started: list[Container] = []
        self.volumes: list[str] = []

    def __call__(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        out = subprocess.run(["podman", "--runtime", "runc", *args], env=self.env, capture_output=True, text=True,
                             timeout=timeout)
        if check:
            assert out.returncode == 0, f"podman {' '.join(args)}: {out.returncode} {out.stderr}"
        return out

    def volume(self) -> str:
        name = f"kilnproxy-test-{uuid.uuid4().hex[:8]}"
        self("volume", "create", name)
        self.volumes.append(name)
        return name

    async def start(self, volume: str, *args: str, env: dict[str, str] | None = None) -> "Container":
        """A detached container of the image on ``volume`` at /data, its port 8080 on a free loopback port;
        returns once it printed its banner (its log, followed: no polling)."""
        name = f"kilnproxy-test-{uuid.uuid4().hex[:8]}"
        options = [f"--env={k}={v}" for k, v in (env or {}).items()]
        started = time.monotonic()
        self("run", "--detach", "--name", name, "--publish", "127.0.0.1::8080", "--volume", f"{volume}:/data",
             *options, IMAGE, *args)
        self.containers.append(name)
        container = Container(self, name)
        self.started.append(container)
        await container.wait_for_banner()
        container.start_seconds = time.monotonic() - started
        port = self("port", name, "8080/tcp").stdout.strip().rsplit(":", 1)[1]
        container.url = f"http://127.0.0.1:{port}"
        return container

    async def cleanup(self) -> None:
        for container in self.started:
            if container.logs is not None and container.logs.returncode is None:
                container.logs.kill()
            if container.logs is not None:
                await container.logs.communicate()
        for name in self.containers:
            self("rm", "--force", "--time", "0", name, check=False)
        for name in self.volumes:
            self("volume", "rm", "--force", name, check=False)


class Container:
    def __init__(self, podman: Podman, name: str):
        self.podman, self.name = podman, name
        self.url = ""
        self.start_seconds = 0.0
        self.logs: asyncio.subprocess.Process | None = None
        self.lines: list[str] = []

    async def wait_for_banner(self, count: int = 1) -> None:
        """Until its log (from the container's first start) holds ``count`` banners: one per start."""
        if self.logs is not None and self.logs.returncode is None:
            self.logs.kill()
            await self.logs.communicate()
        self.logs = await asyncio.create_subprocess_exec(
            "podman", "logs", "--follow", self.name, env=self.podman.env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        self.lines, seen = [], 0
        while seen < count:
            line = await asyncio.wait_for(self.logs.stdout.readline(), 60)
            assert line, f"the container ended before listening: {self.lines}"
            self.lines.append(line.decode().rstrip("\n"))
            seen += bool(BANNER.search(self.lines[-1]))
        if self.url:  # started again: its port may be another
            port = self.podman("port", self.name, "8080/tcp").stdout.strip().rsplit(":", 1)[1]
            self.url = f"http://127.0.0.1:{port}"

    async def rest_of_log(self) -> list[str]:
        """Its log to the end (once the container has stopped)."""
        rest, _ = await asyncio.wait_for(self.logs.communicate(), 60)
        self.lines += rest.decode().splitlines()
        return self.lines

    def exit_code(self) -> int:
        return int(self.podman("inspect", "--format", "{{.State.ExitCode}}", self.name).stdout)

    def exec(self, *args: str) -> str:
        return self.podman("exec", self.name, *args).stdout


@pytest.fixture
async def podman(podman_env):
    p = Podman(podman_env)
    yield p
    await p.cleanup()


def readme_curl(url: str) -> subprocess.CompletedProcess:
    """The README's curl ("Try the demo"), at ``url``."""
    return subprocess.run(["curl", "-sS", "-N", f"{url}/v1/completions", "-H", "Authorization: Bearer sk-kiln-demo",
                           "-H", "Content-Type: application/json", "-d", README_CURL_BODY],
                          capture_output=True, text=True, timeout=60)


def stream_text(body: str) -> str:
    events = [line[len("data: "):] for line in body.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]", body
    return "".join(c["text"] for e in events[:-1] for c in json.loads(e)["choices"])


async def test_the_demo_answers_the_readme_curl_as_a_user_that_is_not_root(podman):
    container = await podman.start(podman.volume())
    out = readme_curl(container.url)
    assert (out.returncode, out.stderr) == (0, "")
    assert stream_text(out.stdout) == DEMO_TEXT
    assert out.stdout.endswith("data: [DONE]\n\n")
    assert container.exec("id", "-u").strip() == RUN_AS
    assert container.exec("cat", "/proc/1/cmdline").split("\0")[:3] == [
        "/opt/kilnproxy/bin/python3", "/opt/kilnproxy/bin/kilnproxy", "serve"]  # the gateway is PID 1
    status = dict(line.split(":", 1) for line in container.exec("cat", "/proc/1/status").splitlines())
    assert status["Uid"].split() == [RUN_AS] * 4
    assert podman("healthcheck", "run", container.name, check=False).returncode == 0  # the image's HEALTHCHECK
    assert container.exec("ls", "/data").split() == ["kilnproxy.db", "kilnproxy.db-rows", "kilnproxy.db-shm",
                                                    "kilnproxy.db-wal"]
    size = int(podman("image", "inspect", "--format", "{{.Size}}", IMAGE).stdout)
    print(f"\nimage {IMAGE}: {size / 1e6:.0f} MB; container start to listening: {container.start_seconds:.2f} s")


async def test_the_usage_rows_stay_on_the_volume_across_a_restart_and_a_new_container(podman):
    volume = podman.volume()
    first = await podman.start(volume)
    ids = []
    async with aiohttp.ClientSession(headers={"Authorization": "Bearer sk-kiln-demo"}) as http:
        for _ in range(3):
            async with http.post(f"{first.url}/v1/completions", data=README_CURL_BODY) as r:
                assert r.status == 200
                ids.append(r.headers["X-Neocloud-Generation-Id"])
                assert stream_text(await r.text()) == DEMO_TEXT
        async with http.get(f"{first.url}/v1/credits") as r:
            credits = await r.json()
        assert credits["spent"] > 0, credits

        async def rows_are_there(container: Container) -> None:
            for generation in ids:
                async with http.get(f"{container.url}/v1/generations/{generation}") as r:
                    assert r.status == 200
                    row = await r.json()
                    assert (row["id"], row["org"], row["model"], row["status"]) == (generation, "demo", "kiln-demo",
                                                                                    200)
            async with http.get(f"{container.url}/v1/credits") as r:
                assert await r.json() == credits

        podman("restart", "--time", "60", first.name)  # the same container stopped (SIGTERM) and started again
        assert first.exit_code() == 0
        await first.wait_for_banner(count=2)
        await rows_are_there(first)
        podman("stop", "--time", "60", first.name)
        assert first.exit_code() == 0
        second = await podman.start(volume)  # a new container on the same volume
        await rows_are_there(second)


async def test_podman_stop_drains_under_load_with_no_failed_request(podman):
    """Eight clients send the README's request in a loop (400 each at most) while `podman stop` sends SIGTERM:
    the gateway, PID 1, drains (/healthz?ready 503, each response then says Connection: close, which is
    when a client stops sending there), every request gets its whole stream, every one has its usage row,
    and the container's exit status is the gateway's 0."""
    volume = podman.volume()
    container = await podman.start(volume, env={"KILNPROXY__SERVER__DRAIN_SECONDS": "3"})
    done: list[bool] = []  # one per request answered: whether it said Connection: close (the drain)
    failures: list[str] = []
    warmed_up, draining = asyncio.Event(), asyncio.Event()

    async def client(http: aiohttp.ClientSession) -> None:
        for _ in range(400):
            try:
                async with http.post(f"{container.url}/v1/completions", data=README_CURL_BODY) as r:
                    body = await r.text()
                    if r.status != 200 or stream_text(body) != DEMO_TEXT:
                        failures.append(f"{r.status} {body[:200]}")
                        return
                    closing = r.headers.get("Connection", "").lower() == "close"
            except (aiohttp.ClientError, asyncio.TimeoutError, AssertionError) as exc:
                failures.append(repr(exc))
                return
            done.append(closing)
            if len(done) >= 40:
                warmed_up.set()
            if closing:  # the replica drains: a balancer takes it out, the client goes elsewhere
                draining.set()
                return

    headers = {"Authorization": "Bearer sk-kiln-demo", "Content-Type": "application/json"}
    async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=30)) as http:
        clients = [asyncio.create_task(client(http)) for _ in range(8)]
        await asyncio.wait_for(warmed_up.wait(), 60)
        started = time.monotonic()
        stop = await asyncio.create_subprocess_exec("podman", "--runtime", "runc", "stop", "--time", "60",
                                                    container.name, env=podman.env,
                                                    stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
        await asyncio.wait_for(draining.wait(), 30)
        async with http.get(f"{container.url}/healthz?ready") as r:  # within the 3 s of the drain
            assert (r.status, (await r.json())["status"]) == (503, "not_ready")
        await asyncio.gather(*clients)
        await asyncio.wait_for(stop.wait(), 90)
        stopped = time.monotonic() - started
    assert failures == []
    assert stop.returncode == 0
    assert container.exit_code() == 0
    assert any(done) and len(done) < 8 * 400, len(done)
    assert 3 <= stopped < 30, stopped
    print(f"\n{len(done)} requests answered, {sum(done)} of them during the drain; podman stop took {stopped:.1f} s")
    log = await container.rest_of_log()
    assert any("draining: /healthz?ready answers 503; serving for 3 s more" in line for line in log), log[-5:]
    count = podman("run", "--rm", "--no-healthcheck", "--volume", f"{volume}:/data", "--entrypoint", "python3", IMAGE,
                   "-c", "import sqlite3; print(sqlite3.connect('/data/kilnproxy.db')"
                         ".execute('SELECT count(*) FROM usage_events WHERE status = 200').fetchone()[0])")
    assert int(count.stdout) == len(done)  # every request answered has its row, written before the exit


def test_the_environment_configures_the_container_and_a_bad_variable_stops_it_in_one_line(podman):
    out = podman("run", "--rm", "--no-healthcheck", "--env", "KILNPROXY__LOG__ACCESS=false", IMAGE, "check-config")
    assert out.stdout.splitlines() == [
        "<environment>: OK",
        "  listen   0.0.0.0:8080",
        "  storage  /data/kilnproxy.db",
        "  ops      metrics on, access log off, health checks every 10 s on /health, admin loopback, drain 5 s, "
        "shutdown grace 30 s",
        '  setting  server.host = "0.0.0.0" (environment: KILNPROXY__SERVER__HOST)',
        "  setting  log.access = false (environment: KILNPROXY__LOG__ACCESS)",
    ]
    out = podman("run", "--rm", "--no-healthcheck", "--env", "KILNPROXY__SERVER__PORT=http", IMAGE, check=False)
    assert (out.returncode, out.stdout, out.stderr) == (
        2, "", "kilnproxy: error: KILNPROXY__SERVER__PORT: server.port: must be an integer, got 'http'\n")
