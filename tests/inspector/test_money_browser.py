"""Money written one way on every page (kilnproxy/inspector/static/money.js, docs/inspector.md): the formatter
itself in Debian's chromium, and an embeddings row beside a completion row in the inspector's list."""

from browser import chromium_page, tooltip_lines
from money_text import written

from kilnproxy.testing import completion_body

# amount -> as the pages write it: plain decimal, cents, or three significant digits below them
AMOUNTS = [
    (0, "$0.00"), (-0.0, "$0.00"), (125, "$125.00"), (2.5, "$2.50"), (0.5, "$0.50"), (0.1, "$0.10"),
    (0.123456, "$0.123"), (0.0123, "$0.0123"), (0.01, "$0.01"), (0.00999, "$0.00999"), (0.09996, "$0.10"),
    (3.7e-6, "$0.0000037"), (2e-7, "$0.0000002"), (2.0000000001e-6, "$0.000002"), (1.5e-10, "$0.00000000015"),
    (1e-15, "$0.00"), (-1e-15, "$0.00"), (123.456, "$123.46"), (2.125, "$2.13"), (12500, "$12,500.00"),
    (1234567.891, "$1,234,567.89"), (1e21, "$1,000,000,000,000,000,000,000.00"), (-2.5, "-$2.50"),
    (-0.000042, "-$0.000042"), (None, "–"),
]


async def test_the_money_formatter_never_writes_an_exponent(harness):
    async with harness() as h, chromium_page() as page:
        await page.goto(f"{h.url}/ui/")
        await page.wait_for_function("() => typeof money === 'function'")
        texts = await page.evaluate("(amounts) => amounts.map(money)", [a for a, _ in AMOUNTS])
        assert texts == [text for _, text in AMOUNTS]
        assert texts == [written(a) for a, _ in AMOUNTS]  # the rule as docs/inspector.md states it
        assert await page.evaluate("[money(undefined), money(NaN), money(Infinity)]") == ["–", "–", "–"]


def embeddings_too(config):
    config["models"][0]["endpoints"] = ["completions", "embeddings"]


async def test_an_embeddings_row_and_a_completion_row_write_their_costs_alike(harness):
    async with harness(configure=embeddings_too) as h, chromium_page() as page:
        embedded = await h.openai().embeddings.with_raw_response.create(model=h.model, input="a b c")
        async with h.post("/v1/completions", completion_body()) as resp:
            assert resp.status == 200
            completed = resp.headers["X-Neocloud-Generation-Id"]
        rows = {gen: await h.row(gen) for gen in (embedded.headers["X-Neocloud-Generation-Id"], completed)}
        assert [r["endpoint"] for r in rows.values()] == ["embeddings", "completions"]
        assert 0 < rows[completed]["cost"] and min(r["cost"] for r in rows.values()) < 1e-6  # JS: 2e-7 and such

        await page.goto(f"{h.url}/ui/")
        for gen, row in rows.items():
            cell = page.locator(f'#requests tr[data-id="{gen}"] td').nth(6)
            await cell.wait_for()
            assert await cell.inner_text() == written(row["cost"])
            assert "e" not in await cell.inner_text()
        await page.locator(f'#requests tr[data-id="{next(iter(rows))}"]').click()
        await page.wait_for_selector("#detail-facts dd")
        facts = dict(zip(await page.locator("#detail-facts dt").all_inner_texts(),
                         await page.locator("#detail-facts dd").all_inner_texts()))
        assert facts["cost"] == written(next(iter(rows.values()))["cost"])

        # the usage view's cost chart: its axis and its tooltips write money the same way
        await page.click("#tab-usage")
        await page.wait_for_function("() => { const c = window.Chart && Chart.getChart('chart-cost');"
                                     " return c && c.data.datasets.length > 0; }")
        ticks = await page.evaluate("Chart.getChart('chart-cost').scales.y.ticks.map(t => t.label)")
        assert ticks and not [t for t in ticks if "e" in t or not t.startswith("$")]
        assert await tooltip_lines(page, "chart-cost") == [f"{h.model}: {written(sum(r['cost'] for r in rows.values()))}"]
