"""The inspector's Batches page, its JSON side: every org's batches with their counts and progress, and a
line's row naming its batch (``GET /ui/api/batches``, ``GET /ui/api/requests/{id}``)."""

from batch_inputs import ended, jsonl_lines, line, submitted

from kilnproxy.testing import OTHER_KEY


async def test_the_batches_page_lists_every_orgs_batches_and_a_row_names_its_batch(gw):
    _, mine = await submitted(gw.openai(), [line(0), line(1)])
    _, theirs = await submitted(gw.openai(OTHER_KEY), [b"not json"])
    mine = await ended(gw.openai(), mine.id)
    await ended(gw.openai(OTHER_KEY), theirs.id)
    async with gw.session.get(f"{gw.url}/ui/api/batches") as resp:
        assert resp.status == 200
        listed = (await resp.json())["data"]
    assert [(b["id"], b["org"], b["status"], b["progress"]) for b in listed] == [
        (theirs.id, "globex", "failed", 0.0), (mine.id, "acme", "completed", 1.0)]
    assert listed[1]["request_counts"] == {"total": 2, "completed": 2, "failed": 0}
    async with gw.session.get(f"{gw.url}/ui/api/batches", params={"org": "globex"}) as resp:
        assert [b["id"] for b in (await resp.json())["data"]] == [theirs.id]
    out = jsonl_lines((await gw.openai().files.content(mine.output_file_id)).text)
    async with gw.session.get(f"{gw.url}/ui/api/requests/{out[0]['response']['request_id']}") as resp:
        assert (await resp.json())["row"]["batch_id"] == mine.id
