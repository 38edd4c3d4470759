"""The inspector's paging cursor (``before``), on each store: a cursor whose time is malformed is a 400 naming
``before``; the cursors the inspector gives page through every row."""

import base64

import pytest

from kilnproxy.testing import MODEL

GEN = "X-Neocloud-Generation-Id"


def cursor(text: str) -> str:
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


BAD_TIME = ("before must be the `next` cursor of a previous page: its time is not an ISO-8601 time such as "
            "2026-11-29T20:00:00.123+00:00")


@pytest.mark.parametrize("time", ["x\x00y", "2026-11-29T20:00:00.123+00:00\x00", "2026-13-45T99:99:99.000+00:00",
                                  "zzz", "2026-11-29T20:00:00.123+00:00\n", "２０２６-11-29", "2" * 100])
async def test_a_cursor_whose_time_is_malformed_is_a_400_naming_before(harness, store, time):
    async with harness(overrides=store) as h:
        async with h.session.get(f"{h.url}/ui/api/requests", params={"before": cursor(f"{time}~5")}) as resp:
            assert resp.status == 400
            assert await resp.json() == {"error": {"message": BAD_TIME, "type": "invalid_request_error",
                                                   "param": "before", "code": "invalid_request"}}


async def test_the_cursors_the_inspector_gives_still_page_through_every_row(harness, store):
    async with harness(overrides=store) as h:
        ids = []
        for _ in range(5):
            async with h.post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1}) as resp:
                ids.append(resp.headers[GEN])
        seen, url = [], f"{h.url}/ui/api/requests?limit=2"
        while url:
            async with h.session.get(url) as resp:
                assert resp.status == 200
                page = await resp.json()
            seen += [r["id"] for r in page["data"]]
            url = f"{h.url}/ui/api/requests?limit=2&before={page['next']}" if page["next"] else None
    assert seen == ids[::-1]
