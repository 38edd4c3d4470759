"""GET /v1/generations/{id}: the usage row, for the org that owns it only (the endpoints (docs/reference.md))."""

from kilnproxy.testing import KEY, MODEL, OTHER_KEY
from kilnproxy.usage import COLUMNS

GEN = "X-Neocloud-Generation-Id"


async def get(h, generation_id, key=KEY):
    async with h.session.get(f"{h.url}/v1/generations/{generation_id}", headers=h.headers(key)) as resp:
        return resp.status, await resp.json()


async def test_the_owner_sees_its_row(gw):
    async with gw.post("/v1/completions", {"model": MODEL, "prompt": "hi there", "max_tokens": 3}) as resp:
        answer = await resp.json()
        gen_id = resp.headers[GEN]
    status, row = await get(gw, gen_id)
    assert status == 200
    assert list(row) == list(COLUMNS)
    assert row == await gw.row(gen_id)
    assert (row["id"], row["org"], row["key_id"], row["status"]) == (gen_id, "acme", "acme-key", 200)
    assert row["cost"] == answer["usage"]["cost"]


async def test_error_rows_are_visible_too(gw):
    async with gw.post("/v1/completions", {"model": "nope"}) as resp:
        gen_id = resp.headers[GEN]
    status, row = await get(gw, gen_id)
    assert (status, row["status"], row["error_code"]) == (200, 404, "model_not_found")


async def test_another_org_and_an_unknown_id_get_404(gw):
    async with gw.post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1}) as resp:
        gen_id = resp.headers[GEN]
    for status, answer in (await get(gw, gen_id, OTHER_KEY), await get(gw, "gen-000000000000000000000000")):
        assert status == 404
        assert answer["error"]["code"] == "generation_not_found"
    _, other = await get(gw, gen_id, OTHER_KEY)
    _, unknown = await get(gw, "gen-000000000000000000000000")
    assert other["error"]["message"].replace(gen_id, "X") == unknown["error"]["message"].replace(
        "gen-000000000000000000000000", "X")  # nothing tells another org that the id exists
    async with gw.session.get(f"{gw.url}/v1/generations/{gen_id}") as resp:
        assert resp.status == 401
