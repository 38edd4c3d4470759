"""Chromium for the inspector's browser tests (Debian's /usr/bin/chromium, driven by Playwright; ``make
browser``): ``chromium_page()`` opens a page that fails the test on any page error or Content-Security-Policy
refusal; ``stream_through(h, prompt)`` streams one request through a gateway; ``tooltip_lines(page, chart)``, what a
Chart.js chart's tooltip says over a bar. Screenshots go to ``ARTIFACTS``
(tests/artifacts, or ``$KILNPROXY_ARTIFACTS``)."""

import os
from contextlib import asynccontextmanager
from pathlib import Path

from playwright.async_api import async_playwright


CHROMIUM = "/usr/bin/chromium"


ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]


ARTIFACTS = Path(os.environ.get("KILNPROXY_ARTIFACTS", Path(__file__).parent / "artifacts"))


@asynccontextmanager
async def chromium_page():
    assert os.access(CHROMIUM, os.X_OK), f"{CHROMIUM} is missing: run `make browser` (apt-get install chromium)"
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            page = await browser.new_page(viewport={"width": 1440, "height": 1100})
            errors = page.kiln_errors = []  # a test may take out an error it expects
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            # the page must work within its Content-Security-Policy: anything it refuses is an error too
            page.on("console", lambda msg: errors.append(msg.text)
                    if msg.type == "error" and "Content Security Policy" in msg.text else None)
            yield page
            assert errors == [], errors
        finally:
            await browser.close()


async def stream_through(h, prompt: str) -> str:
    body = {"model": h.model, "prompt": prompt, "max_tokens": 6, "stream": True,
            "stream_options": {"include_usage": True}, "mock": {"delay": 0.02}}
    async with h.post("/v1/completions", body) as resp:
        assert resp.status == 200
        assert (await resp.read()).endswith(b"data: [DONE]\n\n")
        return resp.headers["X-Neocloud-Generation-Id"]


async def tooltip_lines(page, chart: str, index: int | None = None) -> list[str]:
    """The lines of the tooltip of the Chart.js chart on canvas ``chart`` over bar ``index`` (the first that is
    not 0 by default) of every dataset, as the page writes them (its own callbacks, or Chart.js's)."""
    return await page.evaluate("""([name, index]) => {
      const c = Chart.getChart(name);
      const at = index === null ? c.data.datasets[0].data.findIndex((v) => v > 0) : index;
      c.tooltip.setActiveElements(c.data.datasets.map((_, d) => ({ datasetIndex: d, index: at })), { x: 0, y: 0 });
      c.update();
      return c.tooltip.body.flatMap((b) => b.lines);
    }""", [chart, index])
