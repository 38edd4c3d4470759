"""The usage row's ``upstream`` (SPEC 13): the URL of the upstream whose answer the client got, as written in
``upstreams``, userinfo removed; the last one tried after a failover; null when none answered. A SQLite ledger
made before the column gets it when the gateway opens it."""

import sqlite3

import pytest
from closed_ports import refused_port

from kilnproxy.proxy.request_record import shown_url
from kilnproxy.testing import Harness
from kilnproxy.web.server import start_mock

def model_urls(urls, **model):
    def configure(config):
        config["models"][0]["upstreams"] = urls
        config["models"][0].update(model)
    return configure


async def chat(h: Harness, **extra) -> tuple[int, str]:
    async with h.post("/v1/chat/completions", {"model": "test-model", "max_tokens": 2,
                                               "messages": [{"role": "user", "content": "hi"}], **extra}) as resp:
        await resp.read()
        return resp.status, resp.headers["X-Neocloud-Generation-Id"]


def test_userinfo_removed_nothing_else_normalised():
    assert shown_url("http://gpu1:8080/v1") == "http://gpu1:8080/v1"
    assert shown_url("https://user:p%40ss@GPU1.example:443/v1/") == "https://GPU1.example:443/v1/"
    assert shown_url("http://u@h/v1?x=a@b") == "http://h/v1?x=a@b"
    assert shown_url("http://h:1/v1?next=a@b") == "http://h:1/v1?next=a@b"
    assert shown_url(None) is None


@pytest.mark.asyncio
async def test_the_row_names_the_upstream_that_answered(tmp_path):
    mock = await start_mock()
    try:
        host = mock.url.split("://", 1)[1]
        dead = f"http://127.0.0.1:{refused_port()}/v1"
        written = f"http://someone:secret@{host}/v1"
        async with Harness(tmp_path, configure=model_urls([dead, written], routing="round_robin", load_poll=0)) as h:
            seen = set()
            for _ in range(2):  # in turn: once the dead one first (failover to the mock), once the mock first
                status, gen = await chat(h)
                assert status == 200
                row = await h.row(gen)
                seen.add(row["upstream"])
            assert seen == {f"http://{host}/v1"}
    finally:
        await mock.stop()


@pytest.mark.asyncio
async def test_the_last_upstream_tried_whose_error_the_client_got(tmp_path):
    async with Harness(tmp_path) as h:
        status, gen = await chat(h, mock={"fail": "503"})
        assert status == 502  # the upstream's 503, answered as upstream_error
        assert (await h.row(gen))["upstream"] == f"{h.mock_url}/v1"


@pytest.mark.asyncio
async def test_null_when_no_upstream_answered(tmp_path):
    dead = f"http://127.0.0.1:{refused_port()}/v1"
    async with Harness(tmp_path, configure=model_urls([dead])) as h:
        status, gen = await chat(h)
        assert status == 502
        row = await h.row(gen)
        assert row["upstream"] is None and row["error_code"] == "upstream_unreachable"


@pytest.mark.asyncio
async def test_a_ledger_made_before_the_column_gets_it_at_open(tmp_path):
    db = tmp_path / "usage.db"
    old = sqlite3.connect(db)
    old.executescript("""
        CREATE TABLE usage_events (id TEXT PRIMARY KEY, created_at TEXT NOT NULL, org TEXT NOT NULL,
            key_id TEXT NOT NULL, model TEXT NOT NULL, endpoint TEXT NOT NULL, stream INTEGER NOT NULL DEFAULT 0,
            status INTEGER NOT NULL, error_code TEXT, prompt_tokens INTEGER NOT NULL DEFAULT 0,
            completion_tokens INTEGER NOT NULL DEFAULT 0, cached_tokens INTEGER NOT NULL DEFAULT 0,
            total_tokens INTEGER NOT NULL DEFAULT 0, cost REAL NOT NULL DEFAULT 0, duration_ms REAL, ttft_ms REAL,
            finish_reason TEXT, disconnected INTEGER NOT NULL DEFAULT 0, requested_model TEXT);
        INSERT INTO usage_events (id, created_at, org, key_id, model, endpoint, status, cost, requested_model)
            VALUES ('gen-old', '2026-12-01T00:00:00.000+00:00', 'acme', 'acme-key', 'test-model', 'completions',
                    200, 0.5, 'test-model');
    """)
    old.close()
    async with Harness(tmp_path) as h:
        status, gen = await chat(h)
        assert status == 200
        assert (await h.row(gen))["upstream"] == f"{h.mock_url}/v1"
        old_row = await h.row("gen-old")
        assert old_row["upstream"] is None and old_row["cost"] == 0.5 and old_row["requested_model"] == "test-model"
