"""The ledger's writer: group commit that survives a locked database and odd upstream values,
``record_usage`` plugins told after the commit, and the numbers ops metrics read."""

import asyncio
import sqlite3
import textwrap

import orjson
from aiohttp import web

from kilnproxy.proxy.gateway import GATEWAY
from kilnproxy.testing import MODEL, UPSTREAM_MODEL
from kilnproxy.web.server import start_app

GEN = "X-Neocloud-Generation-Id"
BODY = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4}

RECORDER = textwrap.dedent('''
    """Checks that each row it is told of is already in the database."""
    import sqlite3
    from kilnproxy import hookimpl

    SEEN = []

    @hookimpl
    def startup(gateway):
        SEEN.clear()
        SEEN.append(str(gateway.config.db_path))

    @hookimpl
    async def record_usage(call, usage):
        db = sqlite3.connect(SEEN[0])
        try:
            stored = db.execute("SELECT status FROM usage_events WHERE id = ?", (usage["id"],)).fetchone()
        finally:
            db.close()
        try:
            usage["cost"] = 0
            writable = True
        except TypeError:
            writable = False
        SEEN.append((call.generation_id, usage["id"], usage["status"], stored, writable))
''')


async def test_a_locked_database_delays_the_response_until_its_row_is_committed(gw, eventually):
    """Another program holds the write lock: a lone request's row goes to the row journal and its
    response ends; the rows after it follow it to the writer, and their responses wait for the commit."""
    ledger = gw.app[GATEWAY].ledger
    async with gw.session.post(f"{gw.url}/v1/completions", json=BODY, headers=gw.headers()) as resp:
        assert resp.status == 200  # the file is free: the WAL has frames, the next commit is the loop's
    holder = sqlite3.connect(gw.db, isolation_level=None)
    try:
        holder.execute("BEGIN IMMEDIATE")  # another program holds the write lock
        async with gw.session.post(f"{gw.url}/v1/completions", json=BODY, headers=gw.headers()) as resp:
            assert resp.status == 200  # in the row journal
            journaled = resp.headers[GEN]
        await eventually(lambda: ledger.stats()["commit_failures"] >= 1)
        request = asyncio.create_task(gw.session.post(f"{gw.url}/v1/completions", json=BODY, headers=gw.headers()))
        failures = ledger.stats()["commit_failures"]
        await eventually(lambda: ledger.stats()["commit_failures"] > failures)  # tried again, still locked
        assert not request.done()  # the response waits for its row
        holder.execute("ROLLBACK")
    finally:
        holder.close()
    async with await request as resp:
        assert resp.status == 200
        row = await gw.row(resp.headers[GEN])
    assert row["status"] == 200 and (await gw.row(journaled))["status"] == 200
    stats = ledger.stats()
    assert stats["rows_committed"] == 3 and stats["queue_depth"] == 0


async def test_odd_values_from_the_upstream_do_not_wedge_the_ledger(harness):
    """An upstream whose finish_reason is an object: the row is stored all the same and the
    writer goes on committing the rows after it."""
    async def odd(request: web.Request) -> web.Response:
        body = await request.json()
        answer = {"id": "cmpl-1", "object": "text_completion", "model": UPSTREAM_MODEL,
                  "choices": [{"index": 0, "text": " x", "finish_reason": {"why": ["odd"]}}],
                  "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}}
        if not body.get("stream"):
            return web.json_response(answer)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: " + orjson.dumps(answer) + b"\n\ndata: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", odd)
    server = await start_app(app, "127.0.0.1", 0)
    models = [{"id": MODEL, "upstreams": [f"{server.url}/v1"], "upstream_model": UPSTREAM_MODEL}]
    try:
        async with harness(overrides={"models": models}) as h:
            for stream in (False, True, False):
                async with asyncio.timeout(20):
                    async with h.post("/v1/completions", {**BODY, "stream": stream}) as resp:
                        assert resp.status == 200
                        await resp.read()
                        row = await h.row(resp.headers[GEN])
                assert row["finish_reason"] == '{"why":["odd"]}'  # its JSON, as the client saw it
                assert (row["prompt_tokens"], row["completion_tokens"]) == (2, 1)
    finally:
        await server.stop()


async def test_record_usage_plugins_see_each_row_after_its_commit(harness, tmp_path, eventually):
    plugin = tmp_path / "recorder.py"
    plugin.write_text(RECORDER)
    async with harness(plugins=[str(plugin)]) as h:
        import kilnproxy_plugin_recorder as recorder
        ids = []
        for body in (BODY, {**BODY, "stream": True}, {"model": "nope"}):
            async with h.post("/v1/completions", body) as resp:
                await resp.read()
                ids.append((resp.headers[GEN], resp.status))
        async with h.post("/v1/completions", BODY, key="sk-nobody") as resp:
            assert resp.status == 401
        await eventually(lambda: len(recorder.SEEN) == 4)
        assert recorder.SEEN[1:] == [(gid, gid, status, (status,), False) for gid, status in ids]


class MemoryLedger:
    """Another store behind the ``Ledger`` interface: rows kept in a dict, committed a loop turn later."""

    available, refuses_requests = True, False
    pool = file_users = None  # no pool, no file

    def __init__(self):
        self.rows: dict[str, dict] = {}
        self.queued = 0
        self.commits = self.refused = self.refused_unrecorded = 0
        self.journaled: dict = {}
        self.not_committed: list = []

    def journal_when(self, alone) -> None:
        pass

    def keeps_refused_rows(self) -> bool:
        return True

    async def org_spent(self, org):
        return None

    async def open(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def submit(self, row, tag=None):
        future = asyncio.get_running_loop().create_future()
        self.queued += 1

        def commit():
            self.rows[row["id"]] = dict(row)
            self.queued -= 1
            self.commits += 1
            future.set_result(None)

        asyncio.get_running_loop().call_soon(commit)
        return future

    async def spent_by_org(self):
        return {}

    async def get(self, generation_id):
        return self.rows.get(generation_id)

    def queue_depth(self):
        return self.queued

    def stats(self):
        return {"queue_depth": self.queued}


async def test_another_ledger_slots_in_behind_the_interface(gw):
    gateway = gw.app[GATEWAY]
    await gateway.ledger.close()
    store = gateway.ledger = MemoryLedger()
    ids = []
    for body in (BODY, {**BODY, "stream": True}, {"model": "nope"}):
        async with gw.post("/v1/completions", body) as resp:
            await resp.read()
            ids.append(resp.headers[GEN])
            assert ids[-1] in store.rows  # stored before the response ended
    async with gw.session.get(f"{gw.url}/v1/generations/{ids[0]}", headers=gw.headers()) as resp:
        assert (await resp.json())["id"] == ids[0]
    assert [store.rows[i]["status"] for i in ids] == [200, 200, 404]
